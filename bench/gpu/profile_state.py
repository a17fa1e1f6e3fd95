"""A few forwards (or backwards) of the cuda backend on one anchor shape (h_qk h_v length pass [sequences]), to run
under ncu, e.g.
ncu --kernel-name regex:state_forward --launch-skip 2 --launch-count 1 python3 bench/gpu/profile_state.py 2 8 8192 fwd
(bwd 16/32 8x4096: 16 32 4096 bwd 8)"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gdn_h200 import Impl, make_inputs  # noqa: E402

import deltatrain.torch as ours  # noqa: E402

h_qk, h_v, length = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (2, 8, 8192)
pass_ = sys.argv[4] if len(sys.argv) > 4 else "fwd"
sequences = int(sys.argv[5]) if len(sys.argv) > 5 else 1
x = make_inputs(h_qk, h_v, [length] * sequences, seed=0)
impl = Impl(ours.chunk_gated_delta_rule, x, 128 ** -0.5)
for _ in range(3):
    if pass_ == "fwd":
        impl.forward()
    else:
        impl.prepare_backward()
        impl.backward()
torch.cuda.synchronize()
