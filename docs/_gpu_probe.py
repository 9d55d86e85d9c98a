import torch, breakgraph, traceback
from breakgraph import BreakableCUDAGraph, capture, eager_on_graph
torch.backends.cuda.matmul.allow_tf32 = False
@eager_on_graph
def ident(x): return x * 1
w = torch.randn(4096, 4096, device="cuda") / 64
x = torch.randn(4096, 4096, device="cuda")
def body(x):
    h = ident(x + 0)
    for _ in range(300): h = torch.tanh(h @ w)
    return h
with torch.no_grad():
    body(x); torch.cuda.synchronize()
    ref = body(x).clone(); torch.cuda.synchronize()
    g = BreakableCUDAGraph()
    with capture(g):
        out = body(x)
    snap = out.clone()     # default stream, no sync
    torch.cuda.synchronize()
    print("race after capture (snapshot != final):", not torch.equal(snap, out), "final==ref:", torch.allclose(out, ref, atol=1e-3))
    for name, fn in [("bool mask", lambda t: t[t > 0]), ("sync", lambda t: torch.cuda.synchronize()), ("tolist", lambda t: t.tolist()), ("item cpu", lambda t: torch.ones(2).sum().item())]:
        y = torch.randn(64, device="cuda")
        g = BreakableCUDAGraph()
        try:
            with capture(g):
                fn(y * 2)
            print(name, "captured OK")
        except Exception as e:
            print(name, type(e).__name__, str(e)[:400].replace("\n", " "))
