"""Images in, batches out: image folders, their file index, image decoding, the transforms and
loaders (``pipeline``), the samplers with exact semantics, and the embedded canvas data."""
