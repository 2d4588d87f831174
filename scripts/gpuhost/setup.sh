# The lent one-GPU host (no network): the packages it lacks (CuTe DSL, TVM-FFI, Optuna)
# are staged into .gpuhost/a and .gpuhost/b by a tool of our workspace (not part of this
# repository); call 1 carries .gpuhost/a: bash .gpuhost/a/install.sh; call 2 carries
# .gpuhost/b: source .gpuhost/b/install.sh; then source this file (installs the
# project, keeps multicast off). Elsewhere: pip install the project instead.
# Sourced on the GPU host (after env.sh): install the project with the host's torch.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -2
