"""``python -m relaxkv_sglang.gpu_check`` (:func:`relaxkv_sglang.gpu_check.run.main`)."""

import sys

from relaxkv_sglang.gpu_check.run import main

sys.exit(main())
