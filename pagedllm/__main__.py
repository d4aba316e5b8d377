import sys

from pagedllm.entrypoints.cli import main

sys.exit(main())
