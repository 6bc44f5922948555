"""Beyond one device: layer split (placement.py), the draft on its own device, tensor parallel (tp.py).

docs/MULTI_GPU.md describes the placements, the flags and a plan for 4-8 GPUs and several hosts.
"""

# Every process flashtree spawns gets these: the multi-GPU machines here run with NVLink multicast off,
# so NCCL must not try NVLS and torch must not take symmetric-memory multimem all-reduce paths.
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
