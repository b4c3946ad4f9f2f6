"""Training check: a small randomly initialized HF Llama trained with HF's RMSNorm and with
cupy_rmsnorm's (``cupy_rmsnorm.torch.patch_hf_rmsnorm``), same seed, same data.

    python benchmarks/train_llama.py [--out DIR] [--steps 100] [--layers 4] [--hidden 1024]

The model: LlamaForCausalLM, 4 layers x 1024 (intermediate 2816, 16 heads / 4 KV heads,
vocab 32000), **bf16 parameters** (and bf16 AdamW states, lr 3e-4, no autocast), trained for
100 AdamW steps on random tokens (batch 8 x 512, a fixed generator): once as built, once with
its 9 RMSNorm modules swapped for ours (a copy of the same initial weights). Reported: both
loss curves (every 10th step printed, all in the JSON), max |loss difference| over the steps,
and the median step time of each (CUDA-synchronized wall time of forward + backward +
optimizer step, the first 5 steps left out). Under two minutes on an H200.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for train_llama.json")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=args.seq, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():            # norm weights away from one, so their numerics matter
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.normal_(1.0, 0.1)
    return model.train()


def train(model, batches, args, torch):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, times = [], []
    for ids in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, times


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"train_llama: needs torch and transformers ({e})")
        return 2
    if not torch.cuda.is_available():
        print("train_llama: no CUDA device")
        return 2
    import cupy_rmsnorm.torch as rnt
    start = time.perf_counter()
    hf = build_model(args, torch)
    ours = copy.deepcopy(hf)
    replaced = rnt.patch_hf_rmsnorm(ours)
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    batches = [torch.randint(3, 32000, (args.batch, args.seq), generator=gen, device="cuda")
               for _ in range(args.steps)]
    results = {}
    for name, model in (("hf", hf), ("cupy_rmsnorm", ours)):
        losses, times = train(model, batches, args, torch)
        results[name] = {"losses": losses, "step_s": times,
                         "median_step_ms": 1e3 * statistics.median(times[5:] or times)}
        print(f"{name}: final loss {losses[-1]:.4f}, median step {results[name]['median_step_ms']:.1f} ms", flush=True)
    diffs = [abs(a - b) for a, b in zip(results["hf"]["losses"], results["cupy_rmsnorm"]["losses"])]
    payload = {"config": vars(args), "params": "bfloat16 (AdamW states bfloat16, no autocast)",
               "norms_replaced": replaced, "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(), "results": results, "max_abs_loss_diff": max(diffs),
               "elapsed_s": time.perf_counter() - start}
    print(f"\n{replaced} norms replaced; bf16 parameters; {args.steps} AdamW steps, batch {args.batch} x {args.seq}")
    print(f"{'step':>5} {'hf loss':>9} {'ours loss':>9} {'|diff|':>8}")
    for i in list(range(0, args.steps, 10)) + [args.steps - 1]:
        print(f"{i:5d} {results['hf']['losses'][i]:9.4f} {results['cupy_rmsnorm']['losses'][i]:9.4f} {diffs[i]:8.4f}")
    print(f"max |loss difference| {max(diffs):.4g}; median step: hf {results['hf']['median_step_ms']:.1f} ms, "
          f"cupy_rmsnorm {results['cupy_rmsnorm']['median_step_ms']:.1f} ms; {payload['elapsed_s']:.0f} s in all")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "train_llama.json"), "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
