"""The NAG branch. Importing it first thing matters on machines without a GPU: see below."""

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton runs kernels only in its interpreter. The flag is read when
    # triton.language is first imported (torch may import it on its own, e.g. when a model
    # is built on the meta device), so it is set as soon as the package is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
