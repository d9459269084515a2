"""``python -m lightning_pp``: the ``lightning-pp`` command line (what torchrun's ``-m`` runs).

Also runnable as a file, for launchers that take a script path (``fabric run``)::

    fabric run --devices 8 "$(python -c 'import lightning_pp.__main__ as m; print(m.__file__)')" \
        fit configs/demo_cpu.yaml
"""

import sys

from lightning_pp.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
