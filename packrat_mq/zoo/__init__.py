"""The model zoo: the handlers behind the short names of :data:`packrat_mq.handler.ZOO`."""
