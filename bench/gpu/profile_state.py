"""One forward of the cuda backend on fwd 2/8 1x8192 (the state pass dominates), to run under ncu:
ncu --kernel-name regex:state_forward --launch-skip 2 --launch-count 1 python3 bench/gpu/profile_state.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gdn_h200 import Impl, make_inputs  # noqa: E402

import deltatrain.torch as ours  # noqa: E402

x = make_inputs(2, 8, [8192], seed=0)
impl = Impl(ours.chunk_gated_delta_rule, x, 128 ** -0.5)
for _ in range(3):
    impl.forward()
torch.cuda.synchronize()
