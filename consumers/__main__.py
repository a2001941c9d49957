"""python -m consumers serve <service> [...] | status"""

import sys

from consumers.cli import main

sys.exit(main())
