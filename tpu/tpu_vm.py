"""Run `jaxrl run` on a Cloud TPU VM or pod slice: `python tpu/tpu_vm.py --help`. Needs only Python 3.11+
and gcloud; see docs/tpu.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxrl, installed or not

from jaxrl.launch.tpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
