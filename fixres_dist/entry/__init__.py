"""From a command line to running ranks: the scripts' parsers (``cli``), their start (``scripts``:
parse, then import the launcher), the launcher and exit statuses (``launch``), and the seconds
before torch loads (``startup``). Nothing here imports torch at package import time."""
