import sys, torch
sys.path.insert(0, "tests")
import test_transformers as T
for arch in T.ARCHS:
    m = T.model_for(arch, "cuda")
    r = T.make_runner(m, "cuda")
    g = torch.Generator().manual_seed(1234)
    errs, rel, margins, flips = [], [], [], []
    for lengths in [[20, 20, 8], [9, 7]] + T.random_batches(g, 10):
        ps = T.prompts_of(lengths, "cuda", g)
        out = r.prefill(ps)
        for i, p in enumerate(ps):
            ref = T.eager_last_logits(m, p).float(); got = out.logits[i].float()
            e = (got - ref).abs().max().item(); errs.append(e); rel.append(e / ref.abs().max().item())
            t = ref.topk(2).values; mg = (t[0] - t[1]).item(); margins.append(mg)
            if got.argmax() != ref.argmax(): flips.append((mg, e)) if isinstance(flips, list) else None
    r.close()
    print(f"{arch:10s} max err {max(errs):.4f} max rel {max(rel):.4f} median margin {sorted(margins)[len(margins)//2]:.4f} "
          f"n>{T.ARGMAX_MARGIN}: {sum(x > T.ARGMAX_MARGIN for x in margins)}/{len(margins)}")
