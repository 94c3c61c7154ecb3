"""`python -m dflow_rt`: the `dflow-rt` command."""

import sys

from dflow_rt.commands.main import main

sys.exit(main())
