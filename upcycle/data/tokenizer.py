"""The tokenizer of a decoder-only run: a checkpoint's own, or one trained offline.

A HuggingFace checkpoint directory carries its tokenizer: `tokenizer.json` (HF `tokenizers`)
or `tokenizer.model` (SentencePiece), with `bos_token_id` / `eos_token_id` in `config.json`
(or `tokenizer_config.json`'s tokens). `load(spec)` takes such a directory (local or gs://),
or a run directory / its `checkpoints/<step>` (a run keeps its tokenizer in `tokenizer/`), or
the name of an offline BPE (`OFFLINE_BPES`): a byte-level BPE of `OFFLINE_VOCAB_SIZE` pieces
(`OFFLINE_SPECIAL` at ids 0, 1, 2) trained deterministically (`train_bpe`) on the training
split of an offline corpus (`upcycle.data.offline_text`), cached under `~/.cache/upcycle/`
(`UPCYCLE_CACHE` moves it):

  'offline_stdlib_bpe'    (`OFFLINE_BPE`, the default) the standard library's source
                          ('stdlib', ~8 MB, ~2 s to train): the same file from the same Python
                          build, cached per Python version.
  'offline_packages_bpe'  (`OFFLINE_PACKAGES_BPE`) the source of setup.py's pinned numpy,
                          scipy, scikit-learn and matplotlib ('packages', ~25 MB, ~6 s), cached
                          per corpus digest and `tokenizers` version: where the corpus is the
                          pinned one (`offline_text.PACKAGES_DIGEST`) its tokenizer.json is the
                          same file on every machine, sha256 `OFFLINE_PACKAGES_BPE_SHA256` (with
                          setup.py's tokenizers). Elsewhere a run on that corpus says so in one
                          line (`offline_text.mismatch_warning`), and the BPE trained here is
                          another; on the pinned corpus, a BPE that is not the pinned file
                          (another `tokenizers` trained it) is named by `pin_warning`.

Text is encoded without the tokenizer's own special tokens; the pipeline adds BOS and EOS
itself, so every tokenizer frames a document the same way. A directory's chat template
(`chat_template.jinja`, as transformers 5 saves it, else `tokenizer_config.json`'s
`chat_template`) travels with the files: `Tokenizer.chat_template`, which the SFT pipeline
renders (`upcycle.data.sft`).

Which tokenizer a checkpoint's weights belong to (`trained_with`): a step of a run of ours
records its tokenizer's digest in its saved data position (`dataset/`, `lm.LmPipeline.describe`),
else the run keeps it in `tokenizer/`; an HF directory carries its own files. `check_trained`
refuses, in one line, a tokenizer that is not that one, and `check_fits` one whose ids exceed
the model's embedding rows: both would train or decode on ids the weights were not made for.

Beside the files that map text to ids (`FILES`, whose digest identifies the tokenizer) a
tokenizer carries what a chat user of its HF export relies on (`COMPANIONS`): the chat template
(`chat_template.jinja`, transformers 5's file), the source's `generation_config.json`, and its
`config.json` kept as `SOURCE_CONFIG` (the source's eos list, pad, context length, dtype:
`hf_ids`, `source_config`). A run keeps them in `tokenizer/` with the rest, so an export of the
run writes them back (`upcycle.hf_export`).
"""

import dataclasses
import functools
import hashlib
import json
import os
import sys
import tempfile
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from etils import epath

from upcycle import fields, platforms

OFFLINE_BPE = 'offline_stdlib_bpe'
OFFLINE_PACKAGES_BPE = 'offline_packages_bpe'
OFFLINE_BPES = {OFFLINE_BPE: 'stdlib', OFFLINE_PACKAGES_BPE: 'packages'}   # {name: its corpus}
_OFFLINE_NAMES = ' or '.join(map(repr, OFFLINE_BPES))   # for messages
# sha256 of OFFLINE_PACKAGES_BPE's tokenizer.json, trained on the pinned 'packages' corpus
# (offline_text.PACKAGES_DIGEST) with setup.py's tokenizers.
OFFLINE_PACKAGES_BPE_SHA256 = 'eea0e839c7176858de23ef7bfe4046306e6a0ba2a8fe45ce3d4886d8195c476d'
OFFLINE_VOCAB_SIZE = 4096
OFFLINE_SPECIAL = ('<pad>', '<s>', '</s>')   # ids 0, 1, 2: padding never collides with text
FILES = ('tokenizer.json', 'tokenizer.model', 'tokenizer_config.json',
         'special_tokens_map.json')
COMPANIONS = ('chat_template.jinja', 'generation_config.json')
SOURCE_CONFIG = 'source_config.json'   # an HF source's config.json, as a run keeps it
RUN_SUBDIR = 'tokenizer'
DIGEST_CHARS = 16   # of the digest a step's data position records (`lm.LmPipeline.describe`)
Spec = Union[str, Sequence[str]]


class TokenizerError(ValueError):
  """A tokenizer spec that names nothing usable (one line: what, where, the fix)."""


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """Text <-> ids with the framing ids a causal LM needs.

  Attributes:
    files: {file name: bytes} of the tokenizer files (`FILES`) and their companions
      (`COMPANIONS`, `SOURCE_CONFIG`), copied into a run and an HF export.
    bos_id / eos_id: the ids that open and close every document.
    vocab_size: the tokenizer's pieces (the model's vocabulary may be larger).
    digest: sha256 of `FILES`' files, so a resumed run can check it reads the same ids.
    source: where it was read (a directory, or an offline BPE's name), for messages.
  """
  files: Dict[str, bytes]
  bos_id: int
  eos_id: int
  vocab_size: int
  digest: str
  source: str

  @property
  def short_digest(self) -> str:
    """The digest as a step's data position records it."""
    return self.digest[:DIGEST_CHARS]

  def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
    """`text`'s ids; with `add_special_tokens` framed as transformers' tokenizer frames text
    by default (what lm-eval's HuggingFace backend scores): the special tokens the
    tokenizer.json's post-processor adds (Llama's BOS; none for an offline BPE). A
    tokenizer.model has no such rule here: TokenizerError."""
    if add_special_tokens and 'tokenizer.json' not in self.files:
      raise TokenizerError(
          f'{self.source}: a tokenizer.model alone does not say which special tokens frame '
          "text as transformers frames it. Fix: add the tokenizer's tokenizer.json "
          '(transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d)).')
    backend = _backend(self.digest, self.files)
    return backend.encode(text, add_special_tokens) if add_special_tokens else backend.encode(text)

  def decode(self, ids) -> str:
    return _backend(self.digest, self.files).decode([int(i) for i in ids])

  @property
  def chat_template(self) -> Optional[str]:
    """The Jinja chat template of the files: `chat_template.jinja`, else
    `tokenizer_config.json`'s `chat_template` (a list of named ones: 'default'); None."""
    if 'chat_template.jinja' in self.files:
      return self.files['chat_template.jinja'].decode('utf-8')
    template = self._config().get('chat_template')
    if isinstance(template, list):
      template = {t.get('name'): t.get('template') for t in template}.get('default')
    return template if isinstance(template, str) else None

  def special_tokens(self) -> Dict[str, str]:
    """{'bos_token', 'eos_token'} and any of 'pad_token' / 'unk_token' that
    `tokenizer_config.json` names, as text: what a chat template reads."""
    out = {}
    for name, value in self._config().items():
      if name in ('bos_token', 'eos_token', 'pad_token', 'unk_token'):
        value = value.get('content') if isinstance(value, dict) else value
        if isinstance(value, str):
          out[name] = value
    backend = _backend(self.digest, self.files)
    for name, i in (('bos_token', self.bos_id), ('eos_token', self.eos_id)):
      out.setdefault(name, backend.token(i))
    return out

  @property
  def stop_ids(self) -> Tuple[int, ...]:
    """The ids a generation ends at, as transformers' `generate` has them: the source's
    generation_config.json `eos_token_id` (an int or a list: Llama-3-Instruct's ends at
    `<|end_of_text|>` and `<|eot_id|>`), else its config.json's, else (`eos_id`,)."""
    for name in ('generation_config.json', SOURCE_CONFIG):
      value = _json(self.files, name).get('eos_token_id')
      if value is not None and value != []:
        return tuple(int(i) for i in (value if isinstance(value, list) else [value]))
    return (self.eos_id,)

  def _config(self) -> Dict[str, object]:
    return json.loads(self.files.get('tokenizer_config.json', b'{}'))

  def save(self, directory: str) -> None:
    """Writes the tokenizer files into `directory` (created)."""
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in self.files.items():
      (directory / name).write_bytes(data)


class _HfBackend:

  def __init__(self, data: bytes):
    import tokenizers  # pylint: disable=g-import-not-at-top
    self._tok = tokenizers.Tokenizer.from_str(data.decode('utf-8'))

  def encode(self, text, add_special_tokens=False):
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids):
    return self._tok.decode(ids, skip_special_tokens=True)

  def size(self):
    return self._tok.get_vocab_size(with_added_tokens=True)

  def token_id(self, token):
    return self._tok.token_to_id(token)

  def token(self, i):
    return self._tok.id_to_token(i)


class _SentencePieceBackend:

  def __init__(self, data: bytes):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)

  def encode(self, text):
    return self._sp.encode(text)

  def decode(self, ids):
    return self._sp.decode(ids)

  def size(self):
    return self._sp.get_piece_size()

  def token(self, i):
    return self._sp.id_to_piece(i)

  def token_id(self, token):
    i = self._sp.piece_to_id(token)
    return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i


@functools.lru_cache(maxsize=8)
def _backend_cached(digest: str, kind: str, data: bytes):
  del digest   # the key
  return _HfBackend(data) if kind == 'tokenizer.json' else _SentencePieceBackend(data)


def _backend(digest: str, files: Dict[str, bytes]):
  kind = 'tokenizer.json' if 'tokenizer.json' in files else 'tokenizer.model'
  return _backend_cached(digest, kind, files[kind])


def _digest(files: Dict[str, bytes]) -> str:
  h = hashlib.sha256()
  for name in sorted(set(files) & set(FILES)):   # companions do not change the ids
    h.update(name.encode() + b'\0' + files[name])
  return h.hexdigest()


def _json(files: Dict[str, bytes], name: str) -> Dict:
  return json.loads(files.get(name, b'{}'))


def _token_id(files: Dict[str, bytes], backend, which: str) -> Optional[int]:
  """The id of the `<which>_token` tokenizer_config.json names, or None."""
  token = _json(files, 'tokenizer_config.json').get(f'{which}_token')
  if isinstance(token, dict):
    token = token.get('content')
  return backend.token_id(token) if token else None


def _files(directory: epath.Path) -> Dict[str, bytes]:
  """The files that map text to ids (`FILES`), whose digest identifies the tokenizer."""
  return {name: (directory / name).read_bytes() for name in FILES if (directory / name).exists()}


def _special_id(files: Dict[str, bytes], backend, which: str) -> Optional[int]:
  """`<which>_token_id` from the source's config.json, else the token tokenizer_config.json
  names."""
  value = _json(files, SOURCE_CONFIG).get(f'{which}_token_id')
  if isinstance(value, list):   # instruction-tuned Llama 3: several end ids, the first ends text
    value = value[0] if value else None
  return _token_id(files, backend, which) if value is None else int(value)


def hf_ids(tokenizer: Tokenizer) -> Dict[str, Any]:
  """{'bos_token_id', 'eos_token_id', 'pad_token_id'} as the source's config.json has them (an
  eos list stays a list), else the tokenizer's own (its pad token's id, or None)."""
  source = source_config(tokenizer)
  backend = _backend(tokenizer.digest, tokenizer.files)
  own = {'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id,
         'pad_token_id': _token_id(tokenizer.files, backend, 'pad')}
  return {name: own[name] if source.get(name) is None else source[name] for name in own}


def source_config(tokenizer: Tokenizer) -> Dict[str, Any]:
  """The config.json of the HF checkpoint the tokenizer came from ({} if none)."""
  return _json(tokenizer.files, SOURCE_CONFIG)


def _from_directory(directory: str) -> Tokenizer:
  path = epath.Path(directory)
  files = {name: (path / name).read_bytes() for name in FILES + COMPANIONS
           if (path / name).exists()}
  for name in (SOURCE_CONFIG, 'config.json'):   # a run's kept copy, or an HF directory's own
    if (path / name).exists():
      files[SOURCE_CONFIG] = (path / name).read_bytes()
      break
  if 'tokenizer.json' not in files and 'tokenizer.model' not in files:
    raise TokenizerError(
        f'{directory} holds no tokenizer.json or tokenizer.model: give the HuggingFace '
        f"checkpoint's directory (it carries its tokenizer), or TOKENIZER={_OFFLINE_NAMES}.")
  digest = _digest(files)
  backend = _backend(digest, files)
  bos, eos = (_special_id(files, backend, w) for w in ('bos', 'eos'))
  if bos is None or eos is None:
    raise TokenizerError(
        f'{directory}: no {"bos" if bos is None else "eos"}_token_id in config.json nor its '
        'token in tokenizer_config.json; add it to config.json.')
  return Tokenizer(files=files, bos_id=bos, eos_id=eos, vocab_size=backend.size(), digest=digest,
                   source=directory)


def train_bpe(documents: Iterable[str]) -> bytes:
  """tokenizer.json of a byte-level BPE of `OFFLINE_VOCAB_SIZE` pieces (`OFFLINE_SPECIAL`
  first) trained on `documents`. Deterministic: the trainer breaks ties by pair, so the same
  documents in the same order give the same file byte for byte (whatever the threads)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import (  # pylint: disable=g-import-not-at-top
      decoders, models, pre_tokenizers, trainers)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=OFFLINE_VOCAB_SIZE,
                                special_tokens=list(OFFLINE_SPECIAL),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(documents, trainer=trainer)
  return tok.to_str().encode('utf-8')


def train_offline_bpe(name: str = OFFLINE_BPE) -> bytes:
  """tokenizer.json of the offline BPE `name` (`OFFLINE_BPES`): `train_bpe` on its corpus's
  training split, in corpus order (about 2 s for 'stdlib', 6 s for 'packages' here)."""
  from upcycle.data import offline_text  # pylint: disable=g-import-not-at-top
  return train_bpe(offline_text.CORPORA[OFFLINE_BPES[name]]('train'))


def _cache_path(name: str) -> str:
  """Where the offline BPE `name` is cached: keyed by what its file depends on (the Python
  version for 'stdlib'; for 'packages' the corpus digest and the `tokenizers` that trains it,
  so a file another version trained is not read as this one's)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from upcycle.data import offline_text  # pylint: disable=g-import-not-at-top
  if OFFLINE_BPES[name] == 'stdlib':
    key = 'py' + '.'.join(map(str, sys.version_info[:3]))
  else:
    key = (f'tokenizers{tokenizers.__version__}-'
           f'{offline_text.corpus_record(OFFLINE_BPES[name])["digest"]}')
  return os.path.join(platforms.cache_root(), f'{name}-{OFFLINE_VOCAB_SIZE}-{key}.json')


def pin_warning(tok: Tokenizer, packages_record: Optional[dict] = None) -> Optional[str]:
  """One line naming an `OFFLINE_PACKAGES_BPE` that is not the pinned file although its corpus
  is the pinned text (another `tokenizers` than setup.py's trained it: other ids, so other
  numbers than the README's); None for any other tokenizer, the pinned file, or a corpus that
  is not the pinned one (`offline_text.mismatch_warning` names that). `packages_record`: the
  packages corpus's `offline_text.corpus_record` where the caller has it (None: read here)."""
  if tok.source != OFFLINE_PACKAGES_BPE:
    return None
  import tokenizers  # pylint: disable=g-import-not-at-top
  from upcycle.data import offline_text  # pylint: disable=g-import-not-at-top
  found = hashlib.sha256(tok.files['tokenizer.json']).hexdigest()
  if found == OFFLINE_PACKAGES_BPE_SHA256:
    return None
  if not (packages_record or offline_text.corpus_record('packages'))['matches']:
    return None
  return (f'WARNING: the offline BPE {OFFLINE_PACKAGES_BPE!r} trained here is not the pinned '
          f'file: tokenizer.json sha256 {found} (pinned {OFFLINE_PACKAGES_BPE_SHA256}), by '
          f'tokenizers {tokenizers.__version__} (setup.py pins the one that trains the pinned '
          f"file). The run's ids are other ids: its numbers are not the README's.")


def _offline_bpe(name: str) -> Tokenizer:
  """The offline BPE `name`, read from its cache, or trained and cached."""
  path = _cache_path(name)
  if os.path.exists(path):
    with open(path, 'rb') as f:
      data = f.read()
  else:
    data = train_offline_bpe(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False) as f:
      f.write(data)
    os.replace(f.name, path)   # concurrent first runs each write a whole, identical file
  config = {'bos_token': OFFLINE_SPECIAL[1], 'eos_token': OFFLINE_SPECIAL[2],
            'pad_token': OFFLINE_SPECIAL[0], 'tokenizer_class': 'PreTrainedTokenizerFast',
            'model_max_length': 1 << 30}
  files = {'tokenizer.json': data,
           'tokenizer_config.json': json.dumps(config, indent=2).encode('utf-8')}
  return Tokenizer(files=files, bos_id=1, eos_id=2, vocab_size=OFFLINE_VOCAB_SIZE,
                   digest=_digest(files), source=name)


def _has_files(directory: epath.Path) -> bool:
  return any((directory / name).exists() for name in FILES[:2])


def _directory(spec: str) -> Optional[epath.Path]:
  """The directory `load(spec)` reads: `spec` itself, or the `tokenizer/` of the run it is in
  (a MODEL_DIR, its checkpoints/, one of its steps); None if there is none."""
  path = epath.Path(spec)
  for candidate in (path, path / RUN_SUBDIR, path.parent / RUN_SUBDIR,
                    path.parent.parent / RUN_SUBDIR):
    if _has_files(candidate):
      return candidate
  return None


def load(spec: Spec) -> Tokenizer:
  """An offline BPE's name (`OFFLINE_BPES`), an HF checkpoint directory, or a run directory (or
  a checkpoint in it); several checkpoints (Branch-Train-MiX sources): the one tokenizer they
  all carry."""
  if not isinstance(spec, str):
    return shared(specs=spec, tokenizers=[load(one) for one in spec],
                  binding=f'TOKENIZER={list(spec)!r}')
  if spec in OFFLINE_BPES:
    return _offline_bpe(spec)
  directory = _directory(spec)
  if directory is None:
    raise TokenizerError(
        f'TOKENIZER={spec!r}: no tokenizer.json or tokenizer.model there, nor in a run\'s '
        f"{RUN_SUBDIR}/ above it. Give the HF checkpoint directory or run its weights were "
        f'trained with, or an offline BPE ({_OFFLINE_NAMES}).')
  return _from_directory(os.fspath(directory))


def shared(specs: Sequence[str], tokenizers: Sequence[Tokenizer], *, binding: str) -> Tokenizer:
  """The tokenizer all of `tokenizers` (those `specs` carry, in order) are; TokenizerError
  naming `binding` where two differ (merged embeddings would average rows of different
  pieces)."""
  for spec, tok in zip(specs[1:], tokenizers[1:]):
    if tok.digest != tokenizers[0].digest:
      raise TokenizerError(
          f'{binding}: {spec} carries another tokenizer ({tok.source}, digest '
          f'{tok.short_digest}) than {specs[0]} ({tokenizers[0].source}, digest '
          f'{tokenizers[0].short_digest}): their embeddings index different pieces and cannot be '
          f'merged. Fix: give checkpoints trained with one tokenizer.')
  return tokenizers[0]


def checked_spec(name: str, spec: object) -> Spec:
  """`spec` if it is one (a non-empty string, or a non-empty list of them, made a tuple),
  else ConfigError naming the binding `name`."""
  if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, str) and s for s in spec):
    return tuple(spec)
  if not isinstance(spec, str) or not spec:
    raise fields.ConfigError(
        f'{name} = {spec!r}: expected a tokenizer: an offline BPE ({_OFFLINE_NAMES}), an HF '
        f'checkpoint directory or a run directory (a string), or a list of checkpoints that '
        f'share one.')
  return spec


def files_digest(spec: str, *, run: bool = True) -> Optional[Tuple[str, str]]:
  """(digest `DIGEST_CHARS` long, the directory) of the tokenizer files at `spec` — with `run`,
  also the `tokenizer/` of the run it is in (a MODEL_DIR, its checkpoints/, one of its steps),
  as `load` finds them — or None where there are none."""
  path = epath.Path(spec)
  directory = _directory(spec) if run else (path if _has_files(path) else None)
  return None if directory is None else (_digest(_files(directory))[:DIGEST_CHARS],
                                         str(directory))


def recorded_digest(dataset_state: Optional[Mapping[str, Any]]) -> Optional[str]:
  """The tokenizer digest a step's data position records (`lm.LmPipeline.describe`, in
  `train.host_states.gather`'s form), if any."""
  for shard in (dataset_state or {}).get('shards', {}).values():
    recorded = shard.get('pipeline', {}).get('tokenizer')
    if isinstance(recorded, str):
      return recorded
  return None


def check_fits(tokenizer: Tokenizer, rows: int, *, binding: str, rows_binding: str) -> None:
  """TokenizerError unless every id of `tokenizer` has one of the embedding's `rows` (an id
  past them reads no row: NaN from the first step)."""
  if tokenizer.vocab_size > rows:
    raise TokenizerError(
        f'{binding} reads {tokenizer.source}, whose {tokenizer.vocab_size} pieces have ids up to '
        f'{tokenizer.vocab_size - 1}, but the model\'s embedding has {rows} rows '
        f'({rows_binding} = {rows}). Fix: the tokenizer the model was made for, or '
        f'{rows_binding} = {tokenizer.vocab_size} or more.')
