import sys

from megatron_dapo.plan.cli import main

sys.exit(main())
