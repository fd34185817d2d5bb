"""python -m upcycle.train --gin_file=... [--gin.KEY=VALUE ...]: train a T5 or ViT, dense or MoE.

Gin files bind `train_script.train` (`import __main__ as train_script`), as in T5X; see
configs/runs/. Macros used there: MODEL_DIR, TRAIN_STEPS, BATCH_SIZE,
MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS, INITIAL_CHECKPOINT_PATH.
"""

import sys
from typing import Any, Optional

from upcycle import gin_utils


def train(*, objective: Any, optimizer: Any, config: Any, train_data: Any,
          eval_data: Optional[Any] = None, initializer: Optional[Any] = None) -> dict:
  """Runs `upcycle.train.trainer.Trainer` with gin-built pieces; returns its result."""
  from upcycle.train.trainer import Trainer  # pylint: disable=g-import-not-at-top
  gin_utils.write_config(config.model_dir)
  result = Trainer(objective, optimizer, config, train_data, eval_data, initializer).run()
  gin_utils.write_config(config.model_dir, operative=True)
  return result


if __name__ == '__main__':
  gin_utils.run(train, sys.argv[1:], __doc__)
