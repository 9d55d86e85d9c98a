"""Where breakgraph's code lives, for the two ways it is run.

* Installed (a wheel): ``breakgraph/integrations/transformers/`` is inside the package
  (``pyproject.toml`` maps the top-level ``integrations/`` folder there).
* A source checkout (tests run from the repository root): the integrations stay in the
  top-level ``integrations/`` folder, and ``breakgraph/integrations/__init__.py`` adds that
  folder to its ``__path__``. No ``sys.modules`` surgery, no import-time side effects.

Both paths count as breakgraph's own code (not the user's) when a host-sync error names the
line that caused it.
"""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(PACKAGE_DIR)

#: The checkout's top-level ``integrations/`` folder, or None when breakgraph is installed.
CHECKOUT_INTEGRATIONS_DIR = (
    os.path.join(_ROOT, "integrations")
    if os.path.isfile(os.path.join(_ROOT, "pyproject.toml"))
    and os.path.isdir(os.path.join(_ROOT, "integrations", "transformers"))
    else None
)

#: Directories whose frames are breakgraph's, not the user's.
OWN_DIRS = (PACKAGE_DIR,) + ((CHECKOUT_INTEGRATIONS_DIR,) if CHECKOUT_INTEGRATIONS_DIR else ())
