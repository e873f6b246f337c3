import sys

from relaxkv_sglang.cli import main

sys.exit(main())
