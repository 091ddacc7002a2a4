"""``python -m fixres_dist.bench``: what models cost at each resolution on this device (the command:
:mod:`fixres_dist.bench.__main__`; one setting's measurement: :mod:`fixres_dist.bench.cost`); and
``python -m fixres_dist.bench.strategies``: one model over several parallel layouts on N local ranks
(:mod:`fixres_dist.bench.strategies`; a rank's measurement: :mod:`fixres_dist.bench.trainer_rank`)."""
