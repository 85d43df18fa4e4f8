# Sourced by the scripts that build the CUDA extension: exports CUDA_HOME, unless set, as the
# toolkit folder nvcc itself reports. torch otherwise takes the folder above the nvcc on PATH,
# and a wrapper script there (/usr/local/bin/nvcc) names a folder without the toolkit's headers.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  _top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
  [ -n "$_top" ] && CUDA_HOME=$(cd "$_top" && pwd -P) && export CUDA_HOME
  unset _top
fi
