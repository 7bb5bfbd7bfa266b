#!/bin/bash
# The CUDA paths (tests/cuda) on a lent GPU machine, from the repository root there. Needs the kit
# that scripts/device-kit.sh builds here (.device-kit, git-ignored; carried with the call).
set -u
K=.device-kit
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $K/whl/pyzmq*.whl $K/whl/transitions*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cu12 $K/whl/nvidia_cuda_runtime*.whl || exit 1
cp -r $K/site/* /tmp/site/
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
mkdir -p /tmp/libs
CU12=$(dirname "$(find /tmp/cu12 -name 'libcudart.so.12*' | head -1)")
export LD_LIBRARY_PATH=/tmp/libs:$CU12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ -d /usr/local/nvidia/lib64 ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/usr/local/nvidia/lib64
for i in 1 2 3 4 5 6; do
  missing=$(ldd /tmp/site/mooncake/engine.so | awk '/not found/{print $1}')
  [ -z "$missing" ] && break
  for m in $missing; do [ -e "$K/fallback/$m" ] && cp -L "$K/fallback/$m" /tmp/libs/; done
done
echo "== carried libs used: $(ls /tmp/libs | tr '\n' ' ')"
ldd /tmp/site/mooncake/engine.so | grep -E "not found|cudart|libcuda"
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
python3 -c "import mooncake.engine; print('mooncake.engine imports')" || true
python3 -c "import zmq, transitions, attrs, msgpack, pdkv; print('pdkv imports')" || exit 1
PYTHONUNBUFFERED=1 timeout 360 python3 -m pytest tests/cuda -v -rA -p no:cacheprovider --timeout 300 2>&1 | tee "$OUT/cuda.log"
echo "rc=${PIPESTATUS[0]}"
# With --bench: the control-plane and latency benches on this machine's cores, for comparison with
# the figures of a 2-core machine (the benches print JSON lines and a table).
if [ "${1:-}" = "--bench" ]; then
  nproc
  for run in 1 2 3; do
    timeout 120 python3 -m pdkv bench control > "$OUT/control$run.log" 2>&1
    grep -E '"kind": "(serial|concurrent|summary)"|^ *(serial|concurrent) +[0-9]|all  ' "$OUT/control$run.log"
  done
  [ "${2:-}" = "--control-only" ] && exit 0
  timeout 200 python3 -m pdkv bench latency --sizes 1,16,128 --repeats 5 2>&1 | tail -40 | tee -a "$OUT/bench.log"
fi
