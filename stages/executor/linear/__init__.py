"""The model's linear layers and their weight formats, in the executor process: one
`LinearMethod` per format (base.py: the interface and the choice; dense.py: PyTorch's
F.linear; onednn.py: oneDNN's packed layout). A quantized format is one more file."""
