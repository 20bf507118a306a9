"""Build the tiny base policy of the embedded default into --out (Hugging Face format): a character-level
tokenizer and a small Qwen2 warm-started on the built-in arithmetic task.

    python tools/make_tiny_base.py --out checkpoints/tiny_base            # ~2.5 min on a 2-core CPU
    python tools/make_tiny_base.py --out /tmp/tb --steps 20 --force       # seconds; a useless model

The same command as `python -m megatron_dapo.tiny`; the code and what it writes: megatron_dapo/tiny/base.py.
"""

import sys

from megatron_dapo.tiny.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
