"""From a trained model to its use: the export folder (safetensors weights, the JSON of what they need,
ONNX, a ``torch.export`` program) and predictions over unlabelled images on 1 or N ranks."""
