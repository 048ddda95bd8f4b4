"""Where the batch sampler's kept sets differ from the reference's on a GPU, and why.

``python perf/sampler_ties.py [--json PATH]``: the GPU test's rows
(tests/test_sampling_device.py ``_gpu_case``), and for each row whose kept set differs: its
parameters, the kernel's threshold and kept mass, the reference's from the CPU
probabilities and from the GPU's own probabilities (which separates a difference in ``p``
from one in the search), the tokens in one set only with their ``p`` against the
thresholds, and the mass at the cut against ``top_p`` times the top-k mass.
"""
import argparse
import json
import sys

import numpy as np

sys.path.insert(0, "tests")
from test_sampling_device import _gpu_case  # noqa: E402

from pagedkv import backend  # noqa: E402
from pagedkv.kernels import sampling as S  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    cp = backend.xp
    out = []
    for vocab in (1000, 49_152, 151_936):
        rng = np.random.default_rng(71 + vocab)
        rows = 512 if vocab < 100_000 else 64
        logits, t, p, k, seeds, counters = _gpu_case(rng, rows, vocab)
        d = cp.asarray(logits)
        params = S._params(t, p, k, np.zeros(rows, np.uint64), np.zeros(rows, np.uint64), cp)
        _, thr_k, mass_k = S._launch(d, params, details=True)
        thr_k, mass_k = thr_k.get(), mass_k.get()
        p_cpu = S.probabilities(logits, t)
        p_gpu = S.probabilities(d, t, cp).get()
        thr_c, mass_c = S.thresholds(p_cpu, p, k)
        thr_g, mass_g = S.thresholds(p_gpu, p, k)
        differ = 0
        for r in range(rows):
            if t[r] == 0:
                continue
            kg, kc = p_gpu[r] >= thr_k[r], p_cpu[r] >= thr_c[r]
            if np.array_equal(kg, kc):
                continue
            differ += 1
            only = np.flatnonzero(kg != kc)
            pos = p_cpu[r][p_cpu[r] > 0].astype(np.float64)
            rec = dict(vocab=vocab, row=r, T=float(t[r]), top_p=float(p[r]), top_k=int(k[r]),
                       kept_gpu=int(kg.sum()), kept_cpu=int(kc.sum()),
                       thr_kernel=float(thr_k[r]), thr_ref_cpu_p=float(thr_c[r]),
                       thr_ref_gpu_p=float(thr_g[r]), mass_kernel=float(mass_k[r]),
                       mass_ref_cpu_p=float(mass_c[r]), mass_ref_gpu_p=float(mass_g[r]),
                       p_equal=bool(np.array_equal(p_cpu[r], p_gpu[r])),
                       p_differ=int((p_cpu[r] != p_gpu[r]).sum()),
                       total=float(pos.sum()), only=only[:8].tolist(),
                       only_p_cpu=p_cpu[r][only[:8]].tolist(),
                       only_p_gpu=p_gpu[r][only[:8]].tolist())
            out.append(rec)
            print(json.dumps(rec))
        print(f"vocab {vocab}: {differ} of {rows} kept sets differ")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
