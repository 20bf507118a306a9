import sys

from megatron_dapo.config import main

sys.exit(main())
