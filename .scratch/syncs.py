import collections, random, traceback, warnings, sys
import torch
from flashserve.llm import LLM
from flashserve.sampling_params import SamplingParams
from flashserve.attention.cascade import CascadePolicy
llm = LLM("llama-3.2-1b", load_format="dummy", cascade_attention="on", gpu_memory_utilization=0.5, max_num_seqs=256)
rng = random.Random(0)
prompts = []
for g in range(8):
    shared = [rng.randrange(1, 100000) for _ in range(512)]
    for i in range(16):
        prompts.append(shared + [rng.randrange(1, 100000) for _ in range(40)])
params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:20], params)
for policy_name, policy in (("flat", None), ("cascade", CascadePolicy())):
    llm.engine.executor.cascade = policy
    sites = collections.Counter()
    def show(message, category, filename, lineno, file=None, line=None):
        st = [f for f in traceback.extract_stack() if "flashserve" in f.filename or "flashinfer" in f.filename]
        sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in st[-4:][::-1])] += 1
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    llm.generate(prompts, params)
    torch.cuda.set_sync_debug_mode(0)
    print(policy_name, "sync sites:")
    for k, v in sites.most_common(15):
        print(f"  {v:5d}  {k}")
