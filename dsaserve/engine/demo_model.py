"""The built-in demo model: a small DeepSeek-V4 trained on Shakespeare, shipped with the package.

Every layer kind of the architecture in 7.5 M parameters (15 MB, bf16); `dsaserve up`,
`dsaserve generate` and the workers serve it when no --model is given. How it was trained and how
well it does: its README.md; scripts/train_demo_model.py makes it again.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "dsaserve-demo-v4"
# The demo model with a trained DSpark head instead of its MTP layer (both live under `mtp.*`,
# so they are two checkpoints, as DeepSeek ships V4-Flash-0731 beside V4-Flash):
# scripts/demo_dspark.py makes it, the demo model's README gives both heads' acceptance.
DEMO_DSPARK_MODEL_DIR = DEMO_MODEL_DIR.parent / "dsaserve-demo-v4-dspark"
