"""From a trained model to its use: the export folder (safetensors weights, the JSON of what they need,
ONNX, a ``torch.export`` program) and predictions over unlabelled images on 1 or N ranks."""
from fixres_dist.startup import quiet_native_logs

quiet_native_logs()  # before torch loads: predict's ranks report a lost peer in one line, not c10d's C++ frames
