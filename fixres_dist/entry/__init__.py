"""From a command line to running ranks: the scripts' parsers (``cli``), their start (``scripts``:
parse, then import the launcher) and the launcher and exit statuses (``launch``); the seconds
before torch loads are :mod:`fixres_dist.startup`'s. Nothing here imports torch at package import time."""
