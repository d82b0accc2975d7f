"""
Export to the Hugging Face format (scripts/export_hf.py, docs/interop.md).

configuration_nagchat.py and modeling_nagchat.py are copied into every export folder and loaded from there with
`trust_remote_code=True`: they import torch and transformers only, never the rest of this repo, which the export
folder does not have. tokenizer.py turns the tiktoken BPE into a `tokenizers` BPE with the same ids. Nothing in
training or evaluation imports this package: transformers is an optional extra (`pip install -e '.[hf]'`).
"""
