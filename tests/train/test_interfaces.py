"""The trainer's pluggable parts satisfy the Protocols that document them."""

from tests.train.test_training import TINY_T5, TINY_VIT
from upcycle.models import T5, ViT
from upcycle.train import interfaces, objectives, optimizers, restore


def test_implementations_provide_what_the_trainer_uses():
  for objective in (objectives.Seq2Seq(T5(TINY_T5)), objectives.Classification(ViT(TINY_VIT))):
    assert isinstance(objective, interfaces.Objective)
  for optimizer in (optimizers.Adafactor(), optimizers.AdamW(optimizers.constant_schedule())):
    assert isinstance(optimizer, interfaces.Optimizer)
  for hook in (restore.UpcycleFromDense('/ckpt'), restore.ContinueFromCheckpoint('/ckpt')):
    assert isinstance(hook, interfaces.Initializer)


def test_something_else_is_not_taken_for_one():
  assert not isinstance(T5(TINY_T5), interfaces.Objective)
  assert not isinstance(objectives.Seq2Seq(T5(TINY_T5)), interfaces.Optimizer)
