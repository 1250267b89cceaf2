# Sourced by the scripts in this directory: the repository root, where builds
# go, -j2, and
# the CUDA switch (nvcc from /usr/local/cuda/bin when present; a host-only
# build when there is no nvcc at all).
KVF_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Where build directories go (build/ci-release, ...); override to keep them apart.
KVF_BUILD_ROOT=${KVF_BUILD_ROOT:-$KVF_ROOT/build}
KVF_JOBS=2

if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
if command -v nvcc >/dev/null 2>&1; then
  KVF_CUDA_ARGS=(-DKVF_WITH_CUDA=ON)
  KVF_CUDA_NOTE="CUDA on ($(command -v nvcc))"
else
  KVF_CUDA_ARGS=(-DKVF_WITH_CUDA=OFF)
  KVF_CUDA_NOTE="CUDA off (no nvcc found)"
fi
