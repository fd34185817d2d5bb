"""`UpcycleReport`: what surgery did to every leaf, printable as a table."""

import dataclasses
from typing import Dict, Tuple

COPIED, EXPERTS, ROUTER, SHARED, TAKEN = 'copied', 'experts', 'router', 'shared', 'taken'


@dataclasses.dataclass(frozen=True)
class Entry:
  """One target leaf.

  Attributes:
    path: the target path.
    action: 'copied' (from `source`), 'experts' (expert initializer applied to
      the dense MLP leaf `source`), 'router' (initialized fresh), 'shared' (a
      shared expert's leaf: the dense MLP leaf `source`, or its first d_ff units)
      or 'taken' (growth: from another path `source`, or along one of its axes).
    shape: the target shape.
    dtype: the target dtype.
    source: dense path it came from; '' for routers.
    init: the initializer (repr), or where copies came from.
    note: e.g. 'cast float64 -> float32', 'first 16 of 32 d_ff units'.
  """

  path: str
  action: str
  shape: Tuple[int, ...]
  dtype: str
  source: str
  init: str
  note: str = ''


@dataclasses.dataclass(frozen=True)
class UpcycleReport:
  """Which leaves were copied, made into experts or shared experts, initialized fresh, left
  unused.

  Attributes:
    entries: one per target leaf, in path order.
    unused: dense leaves nothing in the target was made from.
    num_experts: {MoE block path: E}.
    notes: one line per grown MoE block or layer stack (growth).
  """

  entries: Tuple[Entry, ...]
  unused: Tuple[str, ...]
  num_experts: Dict[str, int]
  notes: Tuple[str, ...] = ()

  def _paths(self, action):
    return tuple(e.path for e in self.entries if e.action == action)

  @property
  def copied(self) -> Tuple[str, ...]:
    return self._paths(COPIED)

  @property
  def experts(self) -> Tuple[str, ...]:
    return self._paths(EXPERTS)

  @property
  def fresh(self) -> Tuple[str, ...]:
    return self._paths(ROUTER)

  @property
  def shared(self) -> Tuple[str, ...]:
    return self._paths(SHARED)

  @property
  def taken(self) -> Tuple[str, ...]:
    return self._paths(TAKEN)

  def summary(self) -> str:
    inits = sorted({e.init for e in self.entries if e.action == EXPERTS})
    routers = sorted({e.init for e in self.entries if e.action == ROUTER})
    experts = sorted(set(self.num_experts.values()))
    blocks = len(self.num_experts)
    shared = f', {len(self.shared)} shared-expert leaves' if self.shared else ''
    if self.notes:   # growth: every leaf copied or taken
      return (f'{len(self.entries)} target leaves: {len(self.copied)} copied, '
              f'{len(self.taken)} grown or taken from another path; {len(self.unused)} source '
              f'leaves unused.')
    return (f'{len(self.entries)} target leaves: {len(self.copied)} copied, '
            f'{len(self.experts)} expert leaves in {blocks} MoE block{"s" * (blocks != 1)} '
            f'(experts {", ".join(map(str, experts)) or "-"}; {", ".join(inits) or "-"}), '
            f'{len(self.fresh)} router leaves ({", ".join(routers) or "-"}){shared}; '
            f'{len(self.unused)} dense leaves unused.')

  def __str__(self) -> str:
    rows = [('action', 'path', 'shape', 'dtype', 'from')]
    for e in self.entries:
      if e.action == EXPERTS:
        origin = f'<- {e.source}  {e.init}'
      elif e.action in (SHARED, TAKEN):
        origin = f'<- {e.source}'
      elif e.action == ROUTER:
        origin = e.init
      else:
        origin = '' if e.init == 'copy' else e.init
      origin = '  '.join(x for x in (origin, e.note) if x)
      rows.append((e.action, e.path, str(tuple(e.shape)), e.dtype, origin))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [self.summary()] + [f'  {n}' for n in self.notes] + ['']
    for r in rows:
      lines.append('  '.join(c.ljust(w) for c, w in zip(r[:4], widths)) + '  ' + r[4])
    if self.unused:
      kind = 'source' if self.notes else 'dense'
      lines += ['', f'{kind} leaves left unused:'] + [f'  {p}' for p in self.unused]
    return '\n'.join(line.rstrip() for line in lines)
