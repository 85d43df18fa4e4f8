"""What the comparison's sweeps chose: each system's peak learning rate and the settings of
SlowMo and SparseLoCo's step, with the sweeps that chose them (harness.compare.systems reads
them; benchmarks/lm_compare.py's --lr and --systems run a sweep's cells again)."""

# Each system's peak learning rate for AdamW: the lowest held-out loss of those tried, after 480
# steps of 4 workers on loopback with the comparison's model and batch (2-layer, width 128,
# context 64, batch 8 per worker, warmup 20, H = 4), final bits per byte in brackets:
#   ddp               2e-3 (2.925)  4e-3 (2.929)
#   powersgd_r1       2e-3 (3.626)  4e-3 (3.642)
#   powersgd_r4       2e-3 (3.163)  4e-3 (3.164)
#   decent_dp         4e-3 (3.074)  8e-3 (3.212)
#   torchft_localsgd  4e-3 (3.122)  8e-3 (3.271)
#   torchft_diloco    outer 0.7: 4e-3 (4.157); outer 0.3: 2e-3 (3.755), 4e-3 (3.770);
#                     outer 0.1: 2e-3 (3.589), 4e-3 (3.542)
#   sgp_bf16          2e-3 (3.166)  4e-3 (3.053)  8e-3 (3.029)  1.2e-2 (3.202)
#   overlap_sgp_bf16  4e-3 (3.175)  8e-3 (3.104)
#   sgp_int8          4e-3 (3.052)  8e-3 (3.083)
#   overlap_sgp_int8  4e-3 (3.166)  8e-3 (3.096)
#   sgp_fp8           4e-3 (3.050)  8e-3 (3.075)
#   overlap_sgp_fp8   4e-3 (3.175)  8e-3 (3.084)
#   dpsgd             8e-3 (3.088)
#   localsgd          4e-3 (3.121)  8e-3 (3.239)
#   slowmo            4e-3 (3.737)  8e-3 (3.782)  at slow momentum 0.5 (fairscale's default);
#                     at 4e-3: momentum 0.2 (3.152), 0.0 (3.047, the SGP average alone);
#                     2e-3 at 0.5 (3.755), slow lr 0.5 at 0.5 (3.384)
#   async_diloco_int8 at 4e-3 (AsyncDiLoCo's merge, delayed Nesterov), outer lr and momentum:
#                     0.1 and 0.9 (3.715, diloco's), 0.5 and 0.5 (3.370), 1.0 and 0 (3.357)
#                     (--outer-lr and --outer-momentum, which async_diloco read then)
# (each cell: benchmarks/lm_compare.py --workers 4 --steps 480 --ddp-steps 480 --lr LR
# [--outer-lr OUTER] --systems SYSTEM --no-record). Systems whose workers each step AdamW on
# their own batch and then average models (gossip, decent-dp, LocalSGD) want a larger rate than
# DDP: the mean of n AdamW steps taken on noisy batches is shorter than one step on the mean
# gradient, since AdamW normalizes each step by its own batch's noise. The full-precision SGP
# modes take their bfloat16 twins' rate. ``alone`` is not tuned: its row is the compute floor.
# SlowMo's slow momentum only hurts at H = 4 under AdamW (each inner step is already normalized;
# momentum on 4-step pseudo-gradients overshoots), so it runs at the smallest momentum tried that
# is still SlowMo, 0.2. AsyncDiLoCo's merges come a few at a time and stale: momentum 0.9 on them
# overshoots as SlowMo's does, so it runs at the momentum tried that keeps one, 0.5 (outer lr 0.5:
# the same step as 1.0 without momentum, lr / (1 - momentum)).
PEAK_LR = {
    "alone": 2e-3,
    "ddp": 2e-3,
    "powersgd_r1": 2e-3,
    "powersgd_r4": 2e-3,
    "decent_dp": 4e-3,
    "torchft_localsgd": 4e-3,
    "torchft_diloco": 4e-3,
    "sgp": 8e-3,
    "overlap_sgp": 8e-3,
    "sgp_bf16": 8e-3,
    "overlap_sgp_bf16": 8e-3,
    "sgp_int8": 4e-3,
    "overlap_sgp_int8": 8e-3,
    "sgp_fp8": 4e-3,
    "overlap_sgp_fp8": 8e-3,
    # Not swept yet: overlap_sgp_int8's rate, the closest synchronous mode.
    "async_sgp": 8e-3,
    "async_sgp_int8": 8e-3,
    # Not swept yet: diloco's rate, the same outer step.
    "async_diloco": 4e-3,
    "async_diloco_int8": 4e-3,
    "dpsgd": 8e-3,
    "localsgd": 4e-3,
    "slowmo": 4e-3,
    # Not swept yet: torchft_diloco's inner rate, the same outer step.
    "diloco": 4e-3,
    "diloco_gossip": 4e-3,
    "diloco_gossip_bf16": 4e-3,
    "diloco_int8": 4e-3,
    "diloco_topk2": 4e-3,
    "diloco_topk4": 4e-3,
    "diloco_gossip_topk2": 4e-3,
    "torchft_streaming_diloco_t1": 4e-3,
    "torchft_streaming_diloco_t2": 4e-3,
    "streaming_diloco_t1_fp32": 4e-3,
    "streaming_diloco_t1_int8": 4e-3,
    "streaming_diloco_t2_int8": 4e-3,
    "streaming_diloco_t1_int4": 4e-3,
    "streaming_diloco_t2_int4": 4e-3,
}
SLOWMO_MOMENTUM = 0.2
ASYNC_OUTER_LR, ASYNC_OUTER_MOMENTUM = 0.5, 0.5  # AsyncDiLoCo's outer step (the sweep above)
# SparseLoCo's message, from final bits per byte after 480 steps of diloco_topk2 (4 workers,
# loopback, H = 4, inner lr 4e-3, outer SGD lr 1): at density 1/64, feedback decay 1 (3.311),
# 0.95 (3.232), 0.8 (3.257); at decay 0.95, density 1/32 (3.169), 1/16 (3.155). 4 bits for 2:
# 3.334 against 3.311 (1/64, decay 1); inner lr 8e-3: 3.320. 1/32 is within SparseLoCo's 1-3%,
# and 1/16 buys little for twice the bytes.
SPARSE_DENSITY = 1 / 32
SPARSE_FEEDBACK_DECAY = 0.95
SPARSE_GOSSIP_STEP = 0.25  # gossip_ext.averagings.sparse_gossip.DEFAULT_CONSENSUS_STEP's sweep

# The demo's peak learning rates (python -m harness.demo: 4 workers, 180 steps, DDP 120, warmup
# 10, H = 4, held-out every 20 steps): the lowest final held-out loss of those tried on loopback
# (the rates do not depend on the network), final bits per byte in brackets:
#   alone             1e-3 (4.021)  2e-3 (3.952)  4e-3 (3.977)  8e-3 (4.009)
#   ddp               2e-3 (3.951)  4e-3 (3.904)  8e-3 (3.968)
#   powersgd_r4       2e-3 (3.839)  4e-3 (3.818)
#   decent_dp         2e-3 (3.882)  4e-3 (3.815)  8e-3 (3.876)
#   torchft_localsgd  2e-3 (3.906)  4e-3 (3.826)  8e-3 (3.846)
#   torchft_diloco    2e-3 (4.073)  4e-3 (4.027)  8e-3 (3.998)  1.6e-2 (4.085)
#   overlap_sgp_int8  4e-3 (3.891)  8e-3 (3.789)  1.6e-2 (3.886)
#   sgp_int8          4e-3 (3.777)  8e-3 (3.781)
#   diloco_int8       2e-3 (4.073)  4e-3 (4.026)  8e-3 (4.013)  1.6e-2 (4.090)
# (each cell: benchmarks/lm_compare.py --workers 4 --steps 180 --ddp-steps 120 --warmup 10
# --eval-every 20 --lr LR --systems SYSTEM --no-record). The workers computing alone are swept
# too: at their best rate they still end short of DDP's target, so the target means something.
# A system the demo runs only on request (--systems) takes the comparison's rate (PEAK_LR).
DEMO_LR = {
    **PEAK_LR,
    "alone": 2e-3,
    "ddp": 4e-3,
    "powersgd_r4": 4e-3,
    "decent_dp": 4e-3,
    "torchft_localsgd": 4e-3,
    "torchft_diloco": 8e-3,
    "overlap_sgp_int8": 8e-3,
    "sgp_int8": 4e-3,
    "diloco_int8": 8e-3,
}
