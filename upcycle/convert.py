"""Upcycle a dense checkpoint into an MoE checkpoint on disk, without training; or grow one.

  python -m upcycle.convert --source=/ckpt/t5_1_1_base/checkpoint_1000000 \\
    --gin_file=models/t5_1_1/base.gin --gin_file=moe/paper_t5.gin \\
    --output_dir=/ckpt/t5_base_moe32 [--experts='drop(ratio=0.5)'] [--router=normal] \\
    [--format=t5x] [--output_format=orbax|t5x] [--seed=0] [--step=keep] [--cast] \\
    [--overwrite] [--dry_run] [--no_verify]
  python -m upcycle.convert --source=/ckpt/t5_base_moe32 --gin_file=models/t5_1_1/base.gin \\
    --gin_file=moe/paper_t5.gin --gin.NUM_EXPERTS=64 --output_dir=/ckpt/t5_base_moe64 \\
    --grow_experts=tile

The target model is the gin macro MODEL, as configs/models/* bind it (MODEL = @models.T5(),
@models.ViT() or @models.Llama(); a bare T5Config / ViTConfig / LlamaConfig works too): its
config decides which blocks are MoE, how many experts, shapes and dtypes. --gin_file /
--gin.KEY=VALUE / --gin_bindings / --gin_search_paths work as for training (upcycle/gin_utils.py).

--experts: copy | drop | noise | random | partial | granular | zero_output
(experts.EXPERT_INITS), optionally with arguments as Python literals:
'drop(ratio=0.5, index_sharing="per_matrix")', 'drop(ratio="linear:0.2:0.8")',
'partial(copied=4)', 'granular(granularity=2)', 'zero_output(inner="drop")' (with a shared
expert: the dense model at step 0).
--router: normal | uniform | zeros (router_init.ROUTER_INITS), e.g. 'normal(std=0.02)'; by
default the router of the model family's upcycling recipe: 'normal' for T5 and ViT
(runs/upcycle.gin, the paper's), 'uniform' for a Llama (runs/llm_upcycle.gin, Drop-Upcycling's).
Without them, the restore hook's gin bindings decide as they do for training
(`--gin_file=upcycling/drop.gin` gives Drop here too); a flag that disagrees with them is
refused.
Branch-Train-MiX and UpIT make the experts from several dense checkpoints: give each with
its own --source, in order, and the initializer in gin as for training:
  python -m upcycle.convert --source=/ckpt/branch_a --source=/ckpt/branch_b \
    --gin_file=models/llama/tiny.gin --gin_file=moe/mixtral.gin \
    --gin_file=upcycling/btx.gin --gin.sources.FromCheckpoints.assignment='[0, 1, 0, 1]' \
    --output_dir=/ckpt/btx_moe
(upcycling/upit.gin with --gin.DARE_BASE=... merges the extra experts). Every source is read
lazily, leaf by leaf, as one source is: the non-expert leaves are averaged as they are
written (or taken from `base`).
--step: the output's step: keep (the source's, 0 if its format has none), reset (0), or N.

Growing instead of upcycling (the target is the source's architecture, larger):
--grow_experts=SOURCES: a trained MoE with more experts per block, every new expert (and its
router column) a copy of an old one: tile | router_norm | a list of expert indices, one per
new expert (`upcycling/expert_growth.py`). --grow_depth=LAYER_MAP: more layers per stack,
each a copy of one of the source's: tile | repeat | a list of source layers
(`upcycling/depth_growth.py`). Both are plans like upcycling's, written the same way.

Output (--output_format): `orbax` (default): OUTPUT_DIR/<step>/params/ and
_CHECKPOINT_METADATA, the layout training writes (`upcycle.checkpoints.orbax`), parameters
only; train from it with `Restore(OUTPUT_DIR, modes.Continue())` (upcycle/restore/;
upcycling/continue_from_checkpoint.gin with reuse_optimizer_state = False). `t5x`:
OUTPUT_DIR/checkpoint_<step>/, T5X's native layout (`upcycle.checkpoints.t5x_writer`): parameters
under `optimizer/target` with Flaxformer's MoE names, `state/step`, an empty `state/param_states`
(restore it in T5X as docs/checkpoints.md says). Either way OUTPUT_DIR/upcycling_report.txt holds
the upcycling report, every leaf (the console shows its summary; `upcycling/report_file.py`),
OUTPUT_DIR/config.gin the gin configuration (`python -m upcycle.export --model_dir=OUTPUT_DIR` reads
the model from it), a Llama-family output keeps the source's tokenizer (the one its weights were
trained with, where the step records it; several sources must share one: merged embeddings would
average rows of different pieces) in OUTPUT_DIR/tokenizer/, as a run does
(`upcycle.data.tokenizer`: with its chat template, generation_config.json and the source's
config.json, whose eos list, pad id, context length and dtype `python -m upcycle.export
--format=hf` writes back), and the step records the CRC-32 of every array written in its
`digests/process_0.json` (as a training step does; `describe --verify` and every reader here
check them).
Digests: a source that carries them (a step of a run, an output of convert or export) is first
compared with them, reading each parameter once; changed bytes stop the conversion in one line
naming the array, before anything is written (--no_verify converts it as it is).
Leaves are computed and written one at a time (upcycling/stream.py): peak memory is about
one MoE block (E copies of one dense MLP) plus bounded write buffers, whatever the model size,
so a dense checkpoint converts on a machine smaller than the MoE (benchmarks/convert_memory.py
measures it: +0.46 GiB for a 0.75 GiB MoE, +0.71 GiB for a 3 GiB one).

Safety: the source is only read. The output may not be, contain or lie inside the source; an
existing non-empty OUTPUT_DIR is replaced only with --overwrite. The output is written as every
directory of this project that must appear whole (`checkpoints/atomic_dir.py`): into a hidden
sibling `.OUTPUT_DIR.converting-<time>-<pid>`, renamed to OUTPUT_DIR at the end (an old output
moved aside first, deleted last), so a killed conversion leaves no OUTPUT_DIR. The conversion
holds the lock `.OUTPUT_DIR.converting.lock` while it writes: another conversion into the same
OUTPUT_DIR is refused, naming it, and the next one deletes the hidden work directories killed
conversions left (said on the console, with the killed one's pid and host). --dry_run prints
the plan (the whole upcycling report) and writes nothing.

OUTPUT_DIR may be gs://BUCKET/PATH. GCS has no rename and no OS locks, so there the lock
`.OUTPUT_DIR.converting.lock` is an object (locks/gcs_lock.py: created only if absent, with a
heartbeat; a dead holder's is taken over at once on its own host, elsewhere after 5 minutes),
and the complete work directory is copied object by object into OUTPUT_DIR (an old output is
deleted just before) with the files that mark a step complete last (orbax's
`<step>/commit_success.txt`, T5X's `checkpoint_<step>/checkpoint`; checkpoints/gcs.py), then
deleted. Readers (ours, orbax's, T5X's) see no step until its marker exists, so a killed
conversion leaves nothing that looks valid; one killed while copying leaves an OUTPUT_DIR
without markers (refused as non-empty: rerun with --overwrite).
"""

import argparse
import ast
import dataclasses
import hashlib
import logging
import os
import sys
from typing import Any, Callable, List, Mapping, Optional, Union

from etils import epath

from upcycle import (arguments, checkpoints, console, gin_utils, pretrained, reachability,
                     startup, tree)
from upcycle.checkpoints import atomic_dir, gcs, paths, t5x_writer, verify as verify_lib
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.models import families
from upcycle.optimizer_state import counts
from upcycle.upcycling import experts as experts_lib
from upcycle.upcycling import router_init
from upcycle.upcycling import modes, report_file, stream
from upcycle.upcycling.base import ExpertInit
from upcycle.upcycling.report import UpcycleReport
from upcycle.upcycling.sources import combine

# Named, not __name__: under `python -m upcycle.convert` this module is __main__, whose records
# console.show_progress (the `upcycle` loggers) would not show.
log = logging.getLogger('upcycle.convert')

MODEL_MACRO = 'MODEL'
OUTPUT_FORMATS = ('orbax', 't5x')


class ConvertError(ValueError):
  """A conversion refused before anything was written."""


def parse_init(text: str, choices: Mapping[str, Any], flag: str) -> Any:
  """'name' or 'name(key=literal, ...)' -> choices[name](**kwargs)."""
  try:
    node = ast.parse(text.strip(), mode='eval').body
    if isinstance(node, ast.Name):
      name, kwargs = node.id, {}
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
      name = node.func.id
      kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    else:
      raise ValueError('not a name or a call with keyword arguments')
  except (SyntaxError, ValueError) as e:
    raise ConvertError(f"{flag}={text!r}: cannot parse it ({e}); write e.g. 'drop(ratio=0.5)'.")
  if name not in choices:
    raise ConvertError(f'{flag}={text!r}: {name!r} is not one of {sorted(choices)}.')
  try:
    return choices[name](**kwargs)
  except (TypeError, ValueError) as e:
    raise ConvertError(f'{flag}={text!r}: {e}') from e


def target_from_gin(macro: str = MODEL_MACRO):
  """The MoE model's config from the gin macro `macro` (a T5 / ViT / Llama module, or its
  config)."""
  value = gin_utils.macro_value(macro)
  if value is None:
    raise ConvertError(f'No gin macro {macro}: give a model file (e.g. '
                       f'--gin_file=models/t5_1_1/base.gin) that binds {macro} = @models.T5() '
                       f'plus the moe/ files, or --gin.{macro}=...')
  try:
    families.of(value)
  except TypeError as e:
    raise ConvertError(f'gin macro {macro} is {value!r}: {e}') from None
  return getattr(value, 'config', value)


def _touches_source(output_dir: str, src: str) -> ConvertError:
  return ConvertError(
      f'--output_dir={output_dir} is, contains or lies inside the source {src}; the source '
      f'is never written to. Fix: choose an output directory outside it.')


def _exists_refusal(output_dir: str) -> ConvertError:
  return ConvertError(f'--output_dir={output_dir} already exists and is not empty. Fix: '
                      f'choose another directory, or pass --overwrite to replace it.')


def check_paths(source: str, resolved: str, output_dir: str, overwrite: bool) -> None:
  """Refuses outputs that touch the source, and existing outputs without `overwrite`."""
  if paths.is_url(output_dir):
    return _check_url_paths(source, resolved, output_dir, overwrite)
  out = os.path.realpath(output_dir)
  for src in {os.path.realpath(source), os.path.realpath(resolved)}:
    if out == src or paths.inside(src, out) or (os.path.isdir(src) and paths.inside(out, src)):
      raise _touches_source(output_dir, src)
  if not overwrite and atomic_dir.is_taken(out):
    raise _exists_refusal(output_dir)


def _check_url_paths(source: str, resolved: str, output_dir: str, overwrite: bool) -> None:
  """check_paths for a gs:// output: prefixes instead of real paths; placeholders are empty."""
  where = paths.split_gcs(output_dir)
  if not where or not where[1]:
    raise ConvertError(f'--output_dir={output_dir}: an output URL must be gs://BUCKET/PATH (a '
                       f'path inside a bucket). Fix: e.g. --output_dir=gs://BUCKET/moe.')
  for src in {paths.absolute(source), paths.absolute(resolved)}:
    if paths.is_url(src) and (src == output_dir or src.startswith(output_dir + '/') or
                              output_dir.startswith(src + '/')):
      raise _touches_source(output_dir, src)
  if not overwrite and gcs.has_content(output_dir):
    raise _exists_refusal(output_dir)


def _stem(output_dir: str) -> str:
  """The hidden stem of a conversion's lock and work directories beside `output_dir`
  ('.NAME.converting', `atomic_dir`); a name too long to carry it within the filesystem's 255
  bytes is cut and told apart by its digest."""
  name = os.path.basename(output_dir)
  if len(name.encode()) > 200:
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    name = f'{name.encode()[:160].decode(errors="ignore")}-{digest}'
  return os.path.join(os.path.dirname(output_dir), f'.{name}.converting')


def _write_whole(output_dir: str, write: Callable[[str], None], overwrite: bool) -> None:
  """`write(work_dir)`, which then becomes `output_dir` (`atomic_dir`, see the module doc)."""
  writer = atomic_dir.Writer(running=f'another conversion into {output_dir}',
                             killed='a killed conversion', fix='choose another --output_dir',
                             taken=str(_exists_refusal(output_dir)))
  try:
    with atomic_dir.create(output_dir, writer, stem=_stem(output_dir),
                           overwrite=overwrite) as work:
      write(work)
  except FileExistsError as e:
    raise ConvertError(str(e)) from None


def _makes_several(experts: Any) -> bool:
  """Whether `experts` is a class (or partial) that makes experts from several sources
  (`sources.FromCheckpoints`, `sources.Merge`) rather than an initializer or its name."""
  return not isinstance(experts, (str, ExpertInit))


def _sources(ckpts: List[checkpoints.Checkpoint], experts: Any, step: Union[str, int],
             growing: bool):
  """(the checkpoint standing for the sources, the dense params the plan copies from, the
  expert initializer) of one --source, or of Branch-Train-MiX / UpIT's several."""
  if not _makes_several(experts):
    if len(ckpts) > 1:
      raise ConvertError(
          f'--source is given {len(ckpts)} times, and the initializer {experts!r} makes '
          f'experts from one checkpoint. Fix: give one --source, or an initializer that reads '
          f'several (--gin_file=upcycling/btx.gin or upit.gin).')
    return ckpts[0], ckpts[0].params, experts
  if growing:
    raise ConvertError(f'--grow_experts / --grow_depth grow one trained checkpoint, and '
                       f'modes.Upcycle.experts = {experts!r} (gin) makes experts '
                       f'from several. Fix: drop upcycling/btx.gin / upit.gin.')
  ckpt, init = combine(ckpts, experts, step=step, names={
      'step': '--step', 'experts': 'modes.Upcycle.experts'})
  return ckpt, init.shared_params(), init


def _unrolled(model_config: Any) -> Any:
  """The model with its layers unrolled: what convert writes (T5X's layout, `layers_{i}`),
  which a scanned run (SCAN_LAYERS = True) restores by stacking it."""
  if getattr(model_config, 'scan_layers', False):
    return dataclasses.replace(model_config, scan_layers=False)
  return model_config


def _source_tokenizer(sources: List[str], model_config: Any) -> Optional[tokenizer_lib.Tokenizer]:
  """The tokenizer decoder-only `sources` carry (an HF directory's, a run's tokenizer/; several
  sources: the one they share), which the output keeps; None for other families or where a
  source has none (said). Raises ConvertError where a source carries another tokenizer than
  its weights were trained with (a run whose tokenizer/ was replaced) or two sources carry
  different ones."""
  if not families.of(model_config).carries_tokenizer:
    return None
  try:
    tokenizers = [tokenizer_lib.load(source) for source in sources]
  except tokenizer_lib.TokenizerError as e:
    log.info('The output keeps no tokenizer: %s', e)
    return None
  try:
    for source, tok in zip(sources, tokenizers):
      pretrained.check_trained(
          tok, source, binding='convert',
          fix=f'put the tokenizer {source} was trained with in {tok.source}.')
    return tokenizer_lib.shared(specs=sources, tokenizers=tokenizers, binding='--source')
  except tokenizer_lib.TokenizerError as e:
    raise ConvertError(str(e)) from e


def convert(source: Union[str, List[str]], model_config: Any, output_dir: str, *,
            format: Optional[str] = None,  # pylint: disable=redefined-builtin
            experts: Any = 'copy', router: Any = 'normal', seed: int = 0,
            step: Union[str, int] = 'keep', cast: bool = False, overwrite: bool = False,
            dry_run: bool = False, output_format: str = 'orbax', grow_experts: Any = None,
            grow_depth: Any = None, verify: bool = True,
            config_gin: Optional[str] = None) -> UpcycleReport:
  """Upcycles checkpoint `source` into the model of `model_config`, written to `output_dir`
  as `output_format` ('orbax': `<step>/`, 't5x': `checkpoint_<step>/`, T5X's native layout);
  with `grow_experts` (expert_growth sources) or `grow_depth` (a depth_growth layer map) it
  grows the source into that model instead. `source` may be a list of checkpoints when
  `experts` makes experts from several (`sources.FromCheckpoints` / `Merge`, the class or a
  partial of it: Branch-Train-MiX, UpIT). With `verify`, each source's parameters are first
  compared with the digests it carries (`verify.check`; a dry run reads nothing). `config_gin`:
  the gin configuration the model came from, kept as OUTPUT_DIR/config.gin (where `python -m
  upcycle.export` reads the model).

  Returns the surgery report (its summary logged, the whole report in
  OUTPUT_DIR/upcycling_report.txt; logged whole by a dry run). Raises ConvertError (refusals),
  CheckpointError (unreadable source, or bytes that differ from its digests) or ValueError
  (surgery mismatches) before anything is written.
  """
  output_dir = paths.absolute(output_dir)
  if output_format not in OUTPUT_FORMATS:
    raise ConvertError(f'--output_format={output_format!r}: expected one of {OUTPUT_FORMATS}.')
  try:
    step = counts.check(step, '--step')
  except ValueError as e:
    raise ConvertError(str(e)) from e
  source_paths = [source] if isinstance(source, str) else list(source)
  ckpts = [pretrained.load(path, format, lazy=True) for path in source_paths]
  for path, read in zip(source_paths, ckpts):
    check_paths(path, read.path, output_dir, overwrite)
  tokenizer = _source_tokenizer(source_paths, model_config)
  ckpt, dense, experts = _sources(ckpts, experts, step,
                                  growing=grow_experts is not None or grow_depth is not None)
  if tree.is_scanned(dense):   # a run trained with SCAN_LAYERS = True: planned per layer
    log.info('%s holds scanned layers: reading them unrolled (layers_0, layers_1, ...).',
             ckpt.path)
    dense = tree.unroll_scanned(dense)
  target = families.abstract_params(_unrolled(model_config))
  first = counts.start(step, ckpt.step)
  if grow_experts is not None:
    mode = modes.GrowExperts(grow_experts, binding='--grow_experts')
  elif grow_depth is not None:
    mode = modes.GrowDepth(grow_depth, binding='--grow_depth')
  else:
    mode = modes.Upcycle(experts, router, cast)
  plan = mode.plan(dense, target, step=first, layers=model_config.moe_positions())
  for read in ckpts:   # shapes agree: does the function?
    pretrained.check_config(read, model_config)
  written = str(plan.step) if output_format == 'orbax' else f'checkpoint_{plan.step}'
  log.info('%s (%s, step %s) -> %s/%s', ckpt.path, ckpt.format, ckpt.step, output_dir, written)
  for note in ckpt.notes:
    log.info('  reader: %s', note)
  report = plan.report()
  if dry_run:
    log.info('%s', report)
    log.info('Dry run: nothing written.')
    return report
  if verify:
    for read in ckpts:
      verify_lib.check(dataclasses.replace(read, optimizer_state=None))
  log.info('%s', report_file.summary(report, os.path.join(output_dir, report_file.REPORT_FILE)))

  def write(work: str) -> None:
    leaves = stream.leaves(plan, dense, seed)
    if output_format == 't5x':
      t5x_writer.write(work, plan.step, leaves)
    else:
      stream.write(work, plan.step, leaves)
    report_file.write(report, work)
    if tokenizer is not None:
      tokenizer.save(os.path.join(work, tokenizer_lib.RUN_SUBDIR))
    if config_gin is not None:
      epath.Path(work, gin_utils.RUN_CONFIGS[0]).write_text(config_gin)

  _write_whole(output_dir, write, overwrite)
  log.info('Wrote %s/%s.', output_dir, written)
  return report


def _literal(value: Optional[str]) -> Any:
  """A flag's value as a Python literal ('[0, 1]'), else the string itself ('tile')."""
  if value is None:
    return None
  try:
    return ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value


def build_parser() -> argparse.ArgumentParser:
  """convert's own flags; the gin flags (gin_utils.parse_flags) are the rest."""
  parser = arguments.ArgumentParser(
      prog='python -m upcycle.convert', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--source', required=True, action='append',
                      help='dense checkpoint, any supported format; Branch-Train-MiX / UpIT: '
                           'once per source, in order')
  parser.add_argument('--format', choices=checkpoints.FORMATS, default=None,
                      help='skip format detection')
  parser.add_argument('--output_dir', required=True, help='where the MoE checkpoint goes')
  parser.add_argument('--output_format', choices=OUTPUT_FORMATS, default='orbax',
                      help="orbax (this project's runs) or t5x (T5X native checkpoint_<step>/)")
  parser.add_argument('--experts', default=None,
                      help="e.g. copy (the default), 'drop(ratio=0.5)'; or the restore hook's "
                           'gin binding (--gin_file=upcycling/drop.gin)')
  parser.add_argument('--router', default=None,
                      help="e.g. uniform, 'normal(std=0.02)'; default: the model family's "
                           "upcycling recipe's (T5 / ViT: normal; Llama: uniform), or the "
                           "restore hook's gin binding")
  parser.add_argument('--seed', type=int, default=0, help='expert and router initializer seed')
  grow = parser.add_mutually_exclusive_group()
  grow.add_argument('--grow_experts', default=None,
                    help="grow a trained MoE's experts: tile | router_norm | [indices]")
  grow.add_argument('--grow_depth', default=None,
                    help='grow the layers of each stack: tile | repeat | [source layers]')
  parser.add_argument('--step', default='keep', help='keep | reset | N')
  parser.add_argument('--cast', action='store_true',
                      help="also allow casts that round values (float32 into bfloat16 "
                           "parameters); casts that keep them (bfloat16 into float32) need "
                           "nothing; the report lists every cast")
  parser.add_argument('--overwrite', action='store_true', help='replace an existing output')
  parser.add_argument('--dry_run', action='store_true', help='print the report, write nothing')
  parser.add_argument('--no_verify', action='store_false', dest='verify',
                      help='convert the sources as they are, without comparing them with their '
                           'digests first')
  return parser


HOOK = 'upcycle.upcycling.modes.Upcycle'


def _hook_binding(name: str) -> Any:
  """What gin binds to the restore hook's `name` (an instance, a name, or None)."""
  import gin  # pylint: disable=g-import-not-at-top
  try:
    bound = gin.query_parameter(f'{HOOK}.{name}')
  except ValueError:
    return None
  if not isinstance(bound, gin.config.ConfigurableReference):
    return bound
  if not bound.evaluate:   # a class called with the sources (btx.gin, upit.gin)
    return bound.scoped_configurable_fn
  return bound.scoped_configurable_fn()


def _initializer(flag: Optional[str], name: str, choices: Mapping[str, Any], default: str) -> Any:
  """The initializer `--<name>` gives, else the restore hook's gin binding of it (what
  `--gin_file=upcycling/drop.gin` sets for training), else `default`; both given must agree."""
  bound = _hook_binding(name)
  if name == 'experts' and bound is not None and _makes_several(bound):
    if flag is not None:
      raise ConvertError(f'--{name}={flag} and the gin binding modes.Upcycle.{name} '
                         f'= {bound!r} (experts from several checkpoints) disagree. Fix: give '
                         f'one of them.')
    return bound
  if isinstance(bound, str):
    bound = parse_init(bound, choices, f'modes.Upcycle.{name}')
  if flag is None:
    return parse_init(default, choices, f'--{name}') if bound is None else bound
  given = parse_init(flag, choices, f'--{name}')
  if bound is not None and repr(given) != repr(bound):
    raise ConvertError(f'--{name}={flag} and the gin binding modes.Upcycle.{name} '
                       f'= {bound!r} disagree. Fix: give one of them.')
  return given


def main(argv: Optional[List[str]] = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  console.show_progress()
  args, rest = build_parser().parse_known_args(argv)
  gin_args, bindings = gin_utils.parse_flags(rest, 'gin flags of python -m upcycle.convert')
  if reachability.refused({**{'--source' + (f' ({i + 1})' if i else ''): path
                              for i, path in enumerate(args.source)},
                           '--output_dir': args.output_dir}):
    return 1
  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()  # Each call parses its own flags (main may run more than once in a process).
  try:
    gin_utils.parse_gin(gin_args, bindings, read=(MODEL_MACRO,))
    model_config = target_from_gin()
    report_args = dict(
        format=args.format, seed=args.seed, step=args.step, cast=args.cast,
        overwrite=args.overwrite, dry_run=args.dry_run, output_format=args.output_format,
        verify=args.verify,
        experts=_initializer(args.experts, 'experts', experts_lib.EXPERT_INITS, 'copy'),
        router=_initializer(args.router, 'router', router_init.ROUTER_INITS,
                            families.of(model_config).upcycle_router),
        grow_experts=_literal(args.grow_experts), grow_depth=_literal(args.grow_depth))
    growing = '--grow_experts' if args.grow_experts else '--grow_depth' if args.grow_depth else ''
    if growing and (args.experts, args.router, args.cast) != (None, None, False):
      raise ConvertError(f'{growing} copies the source\'s own experts and router columns; '
                         f'--experts, --router and --cast apply to upcycling a dense checkpoint. '
                         f'Fix: drop them.')
    startup.ready()
    convert(args.source, model_config, args.output_dir, config_gin=gin.config_str(),
            **report_args)
  except (ConvertError, checkpoints.CheckpointError, ValueError) as e:
    print(gin_utils.one_line(e, argv), file=sys.stderr)   # --verbose: the traceback first
    return 1
  return 0


if __name__ == '__main__':
  startup.begin()
  sys.exit(main())
