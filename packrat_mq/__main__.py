"""``python -m packrat_mq ...`` is the ``packrat-mq`` command."""
from packrat_mq.cli import main

main()
