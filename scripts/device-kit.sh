#!/bin/bash
# Builds .device-kit for scripts/device-check.sh: what a bare GPU machine (Python 3.12, CUDA torch, no
# network) lacks to run tests/cuda. pyzmq and transitions wheels; the CUDA build of Mooncake cut to its
# transfer engine (the whole wheel is 98 MB, over the 64 MiB a device call carries); the CUDA 12 runtime
# it links; and this machine's copies of the system libraries it needs, used there only where missing.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.device-kit/' .git/info/exclude || echo '/.device-kit/' >> .git/info/exclude
K=.device-kit
rm -rf $K /tmp/pdkv-mooncake-cuda
mkdir -p $K/whl $K/site/mooncake $K/site/mooncake_transfer_engine.libs $K/fallback /tmp/pdkv-mooncake-cuda
pip_download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
pip_download -d $K/whl pyzmq==27.3.0 transitions==0.9.3 nvidia-cuda-runtime-cu12==12.8.90
pip_download -d /tmp/pdkv-mooncake-cuda mooncake-transfer-engine==0.3.13.post1
(cd /tmp/pdkv-mooncake-cuda && unzip -q -o ./*.whl)
M=/tmp/pdkv-mooncake-cuda
cp $M/mooncake/*.py $M/mooncake/engine.so $M/mooncake/libasio.so $M/mooncake/libetcd_wrapper.so $K/site/mooncake/
cp $M/mooncake_transfer_engine.libs/{libgflags,libglog,libyaml,libjsoncpp}* $K/site/mooncake_transfer_engine.libs/
# System libraries engine.so links (the base C/C++ runtime excepted), and mlx5 from ibverbs-providers.
for lib in $(ldd $M/mooncake/engine.so | awk '/=> \/(usr\/)?lib/{print $3}'); do
  case $(basename "$lib") in
    libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|libresolv*|ld-linux*|libstdc++*|libgcc_s*) ;;
    *) cp -L "$lib" $K/fallback/ ;;
  esac
done
(cd /tmp && apt-get download -q ibverbs-providers && dpkg -x ibverbs-providers_*.deb $M/ibp && rm ibverbs-providers_*.deb)
cp -L "$(find $M/ibp -name 'libmlx5.so.1' | head -1)" $K/fallback/
strip --strip-unneeded $K/site/mooncake/*.so $K/site/mooncake_transfer_engine.libs/*.so* $K/fallback/*.so*
cp scripts/device-check.sh $K/run.sh
du -sh $K
