"""`python -m upcycle.lm_eval` (`upcycle.harness`): a checkpoint of ours scored on lm-eval
tasks as lm-eval's own HuggingFace backend scores its export.

The checkpoint: an MoE Llama (models/llama/tiny.gin's shape at 2 layers, 4 experts routed
top 2 as Mixtral) saved as a run with scanned layers and the offline BPE's tokenizer, and its
export (`hf_export`, MixtralForCausalLM). The tasks: YAML files over local JSONL written here
(multiple choice, generation, rolling loglikelihood), a few documents each, some longer than
--max_length, so contexts are cut from the left; nothing is downloaded."""

import dataclasses
import glob
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip('lm_eval', reason="lm-eval comes with pip install -e '.[test]'")

# pylint: disable=g-import-not-at-top,wrong-import-position
from tests import helpers as test_helpers
from tests.checkpoints import helpers
from upcycle import hf_export, pretrained
from upcycle import lm_eval as lm_eval_main
from upcycle.checkpoints import ocdbt_files
from upcycle.checkpoints.orbax import CheckpointManager
from upcycle.data import tokenizer as tokenizer_lib
from upcycle.models import LlamaConfig, llama_hf, scan_layout

CONFIG = LlamaConfig(vocab_size=4096, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     d_ff=256, num_layers=2, layer_norm_epsilon=1e-5,
                     moe=llama_hf.mixtral_moe(4, 2, 0.02))
MODEL_FLAGS = ['--gin_file=models/llama/tiny.gin', '--gin_file=moe/mixtral.gin',
               '--gin.NUM_EXPERTS=4', '--gin.models.LlamaConfig.num_layers=2',
               '--gin.models.LlamaConfig.scan_layers=True']
MAX_LENGTH = 64
TASKS = ('local_mc', 'local_gen', 'local_ppl')
CLASS = ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
         "    def norm(self):\n        return math.sqrt(self.x ** 2 + self.y ** 2)\n\n"
         "    def __repr__(self):\n        return")
DOCS = {
    'local_mc': [
        {'question': 'def add(a, b):\n    return', 'choices': [' a + b', ' a - b', ' None'],
         'answer': 0},
        {'question': 'import os\nprint(os.path.', 'answer': 1,
         'choices': ["join('a', 'b'))", "exists('x'))", 'sep)']},
        {'question': CLASS, 'answer': 0,   # 65 tokens of context: cut from the left
         'choices': [" f'Point({self.x}, {self.y})'", " 'Point'", ' str(self.x)']},
        {'question': 'for i in range(10):', 'choices': ['\n    print(i)', '\n    pass', ' break'],
         'answer': 1},
        {'question': '# The answer is ', 'choices': ['True', 'False'], 'answer': 0},
    ],
    'local_gen': [
        {'prompt': 'def main(argv):\n', 'answer': '    return 0'},
        {'prompt': 'import sys\n\n\n' + CLASS, 'answer': ' self.x'},
        {'prompt': 'x = [1, 2, 3]\ny =', 'answer': ' x'},
    ],
    'local_ppl': [
        {'text': "def f(x):\n    return x * 2\n\n\ndef g(y):\n    if y is None:\n        raise "
                 "ValueError('y')\n    return [f(v) for v in y]\n" * 2},
        {'text': "import collections\ncounts = collections.Counter('abracadabra')\n"},
    ],
}
TYPES = {
    'local_mc': '''output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm''',
    # The random model's continuation of the second prompt says ' action'.
    'local_gen': '''output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n\\n", " action"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match''',
    'local_ppl': '''output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte''',
}


def write_tasks(directory) -> str:
  """The local tasks' JSONL and YAML files in `directory`; returns it (--include_path)."""
  os.makedirs(directory, exist_ok=True)
  for task, docs in DOCS.items():
    data = os.path.join(directory, f'{task}.jsonl')
    with open(data, 'w') as f:
      f.writelines(json.dumps(doc) + '\n' for doc in docs)
    with open(os.path.join(directory, f'{task}.yaml'), 'w') as f:
      f.write(f'task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n'
              f'    test: {data}\ntest_split: test\n{TYPES[task]}\n')
  return str(directory)


@pytest.fixture(scope='module')
def moe_run(tmp_path_factory):
  """(the run's checkpoints/ directory, its HF export, the task directory)."""
  root = tmp_path_factory.mktemp('lm_eval')
  params = helpers.random_params(CONFIG, seed=3, scale=0.2)
  run = root / 'run'
  with CheckpointManager(str(run / 'checkpoints'), async_save=False) as manager:
    manager.save(5, scan_layout.stack(params, dataclasses.replace(CONFIG, scan_layers=True)))
  tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE).save(str(run / tokenizer_lib.RUN_SUBDIR))
  exported = hf_export.export(str(run), str(root / 'hf'), model_config=CONFIG)
  return str(run / 'checkpoints'), exported, write_tasks(root / 'tasks')


def _theirs(exported, tasks):
  """lm-eval's hf backend on the export: its results and samples."""
  import lm_eval  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  return lm_eval.simple_evaluate(
      model='hf', model_args=f'pretrained={exported},dtype=float32,device=cpu,'
      f'max_length={MAX_LENGTH}', tasks=list(TASKS), task_manager=TaskManager(include_path=tasks),
      log_samples=True)


def _responses(samples):
  """{doc_id: its requests' responses} of one task's samples."""
  return {s['doc_id']: s['resps'] for s in samples}


@pytest.mark.slow
def test_scores_are_lm_evals_hf_backend_on_the_export(moe_run, tmp_path, capsys):
  """The run (scanned, MoE) scored without exporting it, on a mesh whose expert axis is split
  in two, in batches of 3: every score lm-eval's hf backend gives the export, every request's
  log-likelihood and greedy flag, every generation; written where users look."""
  checkpoint, exported, tasks = moe_run
  out = tmp_path / 'out'
  assert lm_eval_main.main([
      f'--checkpoint={checkpoint}', f'--tasks={",".join(TASKS)}', f'--include_path={tasks}',
      f'--max_length={MAX_LENGTH}', '--batch_size=3', '--num_expert_partitions=2',
      f'--output_dir={out}', '--log_samples', *MODEL_FLAGS]) == 0
  theirs = _theirs(exported, tasks)
  ours = json.loads((out / 'eval_results.json').read_text())
  assert (ours['checkpoint'], ours['format'], ours['step']) == (checkpoint, 'orbax', 5)
  printed = capsys.readouterr().out
  assert printed.startswith('verify: ')   # the digests' check's progress, then the scores
  assert json.loads(printed[printed.index('\n{') + 1:].split('\neval step')[0]) == ours
  for task in TASKS:
    for key, value in theirs['results'][task].items():
      metric, _, kept = key.partition(',')
      if kept == 'none' and not isinstance(value, str):
        assert ours[f'{task}/{metric}'] == pytest.approx(value, rel=1e-5), (task, metric)
    mine = _responses(json.loads(line) for line in
                      (out / 'samples' / f'{task}.jsonl').read_text().splitlines())
    reference = _responses(theirs['samples'][task])
    assert mine.keys() == reference.keys() == set(range(len(DOCS[task])))
    for doc, responses in reference.items():
      if task == 'local_gen':
        assert mine[doc] == [list(r) for r in responses], doc
        continue
      got, want = np.array([r[0] for r in mine[doc]]), np.array([r[0] for r in responses])
      np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-4)
  generations = [responses[0][0] for _, responses in
                 sorted(_responses(theirs['samples']['local_gen']).items())]
  assert all(generations) and ' action' not in generations[1]   # a stop sequence cut it
  assert ours['local_mc/acc'] == theirs['results']['local_mc']['acc,none']
  assert ours['local_ppl/word_perplexity'] > 1   # scores of a real model, not zeros
  rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
  assert len(rows) == 1 and (rows[0]['step'], rows[0]['split']) == (5, 'eval')
  assert rows[0]['local_mc/acc_norm'] == ours['local_mc/acc_norm']
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  logged = {value.tag: float(tf.make_ndarray(value.tensor))
            for path in glob.glob(str(out / 'tensorboard' / 'eval' / 'events.*'))
            for event in tf.compat.v1.train.summary_iterator(path)
            for value in event.summary.value}
  assert logged['local_ppl/bits_per_byte'] == pytest.approx(ours['local_ppl/bits_per_byte'])


def test_the_default_context_is_lm_evals_for_the_export(moe_run):
  """With no --max_length, the rows are as long as lm-eval's hf backend makes them for the
  export (`resolve_max_length` on its config), for the run and for the export itself; and
  each family's default is transformers'."""
  import transformers  # pylint: disable=g-import-not-at-top
  from lm_eval.models.utils import resolve_max_length  # pylint: disable=g-import-not-at-top
  from upcycle import harness  # pylint: disable=g-import-not-at-top
  checkpoint, exported, _ = moe_run
  want = resolve_max_length(transformers.AutoConfig.from_pretrained(exported))
  run = pretrained.load(checkpoint, model_config=dataclasses.replace(CONFIG, scan_layers=True),
                        lazy=True, with_optimizer_state=False)
  assert harness.context_length(run) == harness.context_length(pretrained.load(
      exported, lazy=True, with_optimizer_state=False)) == want
  for model_type, length in harness.HF_CONTEXT_DEFAULTS.items():
    assert transformers.AutoConfig.for_model(model_type).max_position_embeddings == length


def _error(capsys, *flags):
  assert lm_eval_main.main(list(flags)) == 1
  lines = capsys.readouterr().err.strip().splitlines()
  return lines[-1]


def test_bad_input_is_refused_in_one_line(moe_run, tmp_path, capsys):
  checkpoint, exported, tasks = moe_run
  assert _error(capsys, f'--checkpoint={checkpoint}', '--tasks=local_mc,no_such_task',
                f'--include_path={tasks}') == (
      'error: --tasks=local_mc,no_such_task: lm-eval knows no task no_such_task. Fix: a name '
      '`lm-eval ls tasks` lists, or a YAML task in --include_path.')
  assert _error(capsys, f'--checkpoint={checkpoint}', '--tasks=local_mc',
                f'--include_path={tmp_path / "none"}') == (
      f'error: --include_path={tmp_path / "none"}: no such directory. Fix: a directory of '
      'lm-eval task YAML files.')
  for flag, value, minimum in (('--batch_size', 0, 1), ('--max_length', 1, 2)):
    assert _error(capsys, f'--checkpoint={checkpoint}', '--tasks=local_mc', f'{flag}={value}') == (
        f'error: {flag} = {value}: expected an integer >= {minimum}.')
  step = os.path.join(checkpoint, '5')
  assert _error(capsys, f'--checkpoint={checkpoint}', '--tasks=local_mc',
                f'--include_path={tasks}') == (
      f'error: {step}: this orbax checkpoint does not say which model it holds. Fix: give the '
      "gin files of its model, e.g. --gin_file=models/llama/tiny.gin (a run's "
      'MODEL_DIR/config.gin shows its bindings).')
  offline = tokenizer_lib.load(tokenizer_lib.OFFLINE_BPE)
  swapped = test_helpers.save_swapped_tokenizer(offline, str(tmp_path / 'swapped'))
  assert _error(capsys, f'--checkpoint={exported}', '--tasks=local_mc', f'--include_path={tasks}',
                f'--tokenizer={swapped}') == (
      f'error: --tokenizer={swapped} reads {swapped} (tokenizer digest '
      f'{tokenizer_lib.load(swapped).short_digest}), but the weights of {exported} were trained '
      f'with tokenizer {offline.short_digest} (the tokenizer files in {exported}): they would '
      "read another tokenizer's ids. Fix: leave out --tokenizer (the checkpoint's own), or give "
      'the one the weights were trained with.')
  assert _error(capsys, f'--checkpoint={checkpoint}', '--tasks=local_mc',
                '--logical_axis_rules=zero3') == (
      "error: --logical_axis_rules = 'zero3': expected one of ['default', 'fsdp'] or a list of "
      "(logical axis, mesh axes) pairs, e.g. [('batch', 'data'), ('embed', None)].")
  assert _error(capsys, f'--checkpoint={checkpoint}', '--tasks=local_mc',
                f'--include_path={tasks}', '--gin_file=models/t5_1_1/base.gin') == (
      'error: The model is a T5Config: lm-eval scores decoder-only models (Llama, Mistral, '
      'Qwen2, Mixtral, Qwen2-MoE). Fix: give a models/llama/ gin file, or evaluate it with '
      'python -m upcycle.eval.')


def test_fsdp_splits_the_parameters_over_data_and_scores_as_the_default(moe_run):
  """--logical_axis_rules=fsdp (`load_lm`'s rules) splits every d_model axis over 'data', the
  experts' too (each of the 8 devices holds 8 of the 64 columns), where 'default' replicates
  it; log-likelihoods, greedy flags and generations are those of the default placement."""
  from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
  from upcycle import harness  # pylint: disable=g-import-not-at-top
  from upcycle import partitioning  # pylint: disable=g-import-not-at-top
  mesh = partitioning.make_mesh()
  scored = [Instance(request_type='loglikelihood', doc={}, idx=i,
                     arguments=(doc['question'], choice))
            for i, doc in enumerate(DOCS['local_mc'][:2]) for choice in doc['choices']]
  generated = [Instance(request_type='generate_until', doc={}, idx=i,
                        arguments=(doc['prompt'], {'until': ['\n\n'], 'max_gen_toks': 6}))
               for i, doc in enumerate(DOCS['local_gen'])]
  shards, answers = {}, {}
  for name in ('default', 'fsdp'):
    lm, _ = harness.load_lm(moe_run[1], mesh=mesh, rules=partitioning.RULE_SETS[name],
                            max_length=MAX_LENGTH)
    shards[name] = [{shard.data.shape for shard in x.addressable_shards} for x in (
        lm.params['token_embedder']['embedding'],
        lm.params['decoder']['layers_0']['mlp']['expert']['wi_0']['kernel'])]
    answers[name] = (lm.loglikelihood(scored), lm.generate_until(generated))
  assert shards == {'default': [{(4096, 64)}, {(4, 64, 256)}],
                    'fsdp': [{(4096, 8)}, {(4, 8, 256)}]}
  (likelihoods, generations), (fsdp_likelihoods, fsdp_generations) = answers.values()
  assert [greedy for _, greedy in fsdp_likelihoods] == [greedy for _, greedy in likelihoods]
  np.testing.assert_allclose([ll for ll, _ in fsdp_likelihoods], [ll for ll, _ in likelihoods],
                             rtol=1e-5)
  assert fsdp_generations == generations and all(generations)


def test_a_checkpoint_with_a_flipped_byte_is_refused_in_one_line(moe_run, tmp_path, capsys):
  """One byte flipped inside the stored embedding (it still decodes, to other values): the
  digests the run recorded at save refuse it, in one line, before anything is scored;
  --no_verify (`verify=False`) reads it as it is."""
  from upcycle import harness  # pylint: disable=g-import-not-at-top
  from upcycle import partitioning  # pylint: disable=g-import-not-at-top
  checkpoint, _, tasks = moe_run
  shutil.copytree(os.path.dirname(checkpoint), tmp_path / 'run')   # with its tokenizer/
  damaged = str(tmp_path / 'run' / 'checkpoints')
  step = os.path.join(damaged, '5')
  ref = max(ocdbt_files.value_refs(os.path.join(step, 'params'), 'token_embedder.embedding'),
            key=lambda ref: ref.length)   # its data, not its .zarray
  with open(ref.path, 'r+b') as f:
    f.seek(ref.offset + ref.length // 2)
    byte = f.read(1)[0]
    f.seek(ref.offset + ref.length // 2)
    f.write(bytes([byte ^ 0xFF]))
  line = _error(capsys, f'--checkpoint={damaged}', '--tasks=local_mc', f'--include_path={tasks}',
                *MODEL_FLAGS)
  assert line.startswith(f"error: {step}/params: parameter 'token_embedder/embedding' (shard "
                         '0:4096,0:64): its bytes differ from the digest recorded when the step '
                         'was saved')
  assert line.endswith('Fix: copy the checkpoint again from its source, or pass --no_verify to '
                       'read it as it is.')
  scanned, mesh = dataclasses.replace(CONFIG, scan_layers=True), partitioning.make_mesh()
  rules = partitioning.LOGICAL_AXIS_RULES
  as_is, _ = harness.load_lm(damaged, model_config=scanned, mesh=mesh, rules=rules, verify=False)
  saved, _ = harness.load_lm(checkpoint, model_config=scanned, mesh=mesh, rules=rules)
  changed = (np.asarray(as_is.params['token_embedder']['embedding']) !=
             np.asarray(saved.params['token_embedder']['embedding']))
  assert changed.sum() == 1   # the one float32 entry holding the flipped byte


def test_a_task_that_samples_or_leaves_no_context_is_refused_in_one_line(moe_run):
  from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
  from upcycle import harness  # pylint: disable=g-import-not-at-top
  from upcycle import partitioning  # pylint: disable=g-import-not-at-top
  lm, _ = harness.load_lm(moe_run[1], mesh=partitioning.make_mesh(),
                          rules=partitioning.LOGICAL_AXIS_RULES)
  request = Instance(request_type='generate_until', doc={}, idx=0,
                     arguments=('def', {'do_sample': True, 'temperature': 0.7}))
  with pytest.raises(harness.HarnessError, match=(
      r"^generation_kwargs \{'do_sample': True, 'temperature': 0.7\}: the task samples, and "
      r'upcycle.lm_eval decodes greedily\. Fix: --gen_kwargs=do_sample=False,temperature=0')):
    lm.generate_until([request])
  assert lm.max_length == 131072   # MixtralConfig's default: the export does not say
  request = Instance(request_type='generate_until', doc={}, idx=0,
                     arguments=('def', {'until': ['\n'], 'max_gen_toks': 131072}))
  with pytest.raises(harness.HarnessError, match=(
      r"^max_gen_toks = 131072 \(the task's generation_kwargs or --max_gen_toks\): expected 1 "
      r'to --max_length - 1 = 131071 \(the context takes the rest\)\.$')):
    lm.generate_until([request])
