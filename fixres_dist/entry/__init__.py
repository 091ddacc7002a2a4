"""From a command line to running ranks: the scripts' parsers (``cli``), the launcher and exit
statuses (``launch``), and the seconds before torch loads (``startup``). Nothing here imports torch
at package import time."""
