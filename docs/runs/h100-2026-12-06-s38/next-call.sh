# The next session's first device call, prepared in the thirty-eighth (copy it to tools/gpu/.call1.sh and carry it
# with .whl; ~480 s):
#  1. the fast GPU subset: the memory-snapshot GPU test's fix (7218c16: blocks an earlier GPU test left live carry
#     no stack) was not run on a GPU; everything else on main passed its GPU tests in the thirty-eighth session;
#  2. issue #20's configuration under 24 GiB once more, on whichever GPU comes (the thirty-eighth measured 22.907 GiB
#     on an H100; the issue names the H200, whose fla configurations have shipped since 2026-12-01).
source tools/gpu/device_env.sh
LIMIT_TESTS=240 PARTS=fast-tests bash tools/gpu/device_figures.sh
CAP=24 LIMIT_256K=220 PARTS=capped-256k-snapshot bash tools/gpu/device_figures.sh
