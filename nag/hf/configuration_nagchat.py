"""
The transformers configuration of an exported nag-chat model.

It covers every exported arch: GPT, NAG, NAG-MoD, the router-MoD GPT, GPT / NAG on nanochat's recipe, and the rival
depth arms gpt-lns, gpt-peri and gpt-layerrope (nag/rivals.py: their parameters, LayerRoPE's base b too, are weights).

Copied into the export folder by scripts/export_hf.py and loaded there with trust_remote_code: it imports
transformers only. The field names are the repo's own (nanochat/gpt.py GPTConfig, nag/model.py NAGConfig).
"""

from transformers import PretrainedConfig


class NagChatConfig(PretrainedConfig):
    model_type = "nag_chat"
    # the names transformers' tools look for (lm-eval reads max_position_embeddings as the context length)
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "num_key_value_heads": "n_kv_head",
        "max_position_embeddings": "sequence_len",
    }

    def __init__(
        self,
        arch="gpt",
        vocab_size=32768,
        sequence_len=2048,
        n_layer=12,
        n_head=6,
        n_kv_head=6,
        n_embd=768,
        window_pattern="L",
        nag=None,
        alpha_warmup=1.0,
        mod=None,
        recipe=None,
        **kwargs,
    ):
        # gpt, nag, gpt-router, gpt-recipe, nag-recipe, gpt-lns, gpt-peri or gpt-layerrope (nag/archs.py)
        self.arch = arch
        self.vocab_size = vocab_size
        self.sequence_len = sequence_len
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.n_embd = n_embd
        self.window_pattern = window_pattern
        self.nag = nag  # NAG: {"directions", "mod_floor", "renorm"}
        # NAG: the α warm-up factor at the exported step, min(1, tokens / warm-up tokens)
        self.alpha_warmup = alpha_warmup
        self.mod = mod  # MoD: {"blocks", "rate"}; the thresholds are weights (mod_thresholds)
        self.recipe = recipe  # the recipe archs: which parts are on (nanochat/recipe.py RecipeConfig)
        kwargs.setdefault("tie_word_embeddings", False)  # wte and lm_head are separate matrices
        super().__init__(**kwargs)
