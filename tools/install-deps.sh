#!/usr/bin/env bash
# Installs the Debian packages moegraph builds with, when they are missing.
# As root it runs apt-get; otherwise it prints the exact command and stops.
# The CUDA toolkit itself is a precondition (nvcc in /usr/local/cuda or on PATH);
# the emulated tree needs only Boost.Context (the fibers of emulator/); the CPU
# path's SIMD kernels use Highway (libhwy-dev).
set -euo pipefail

packages=(cmake make g++ clang libclang-rt-14-dev libabsl-dev libgtest-dev libbenchmark-dev gnuplot-nox
  libboost-context-dev libpcre2-dev nlohmann-json3-dev pkg-config libhwy-dev
  libcpp-httplib-dev liburing-dev curl python3)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "install-deps: the CUDA toolkit is missing (no nvcc on PATH or in /usr/local/cuda/bin)." >&2
  echo "install-deps: install CUDA 12.x or 13.x from NVIDIA, then rerun." >&2
  exit 1
fi

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

line="apt-get install -y --no-install-recommends ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
  echo "install-deps: missing packages: ${missing[*]}" >&2
  echo "install-deps: run as root:  apt-get update && $line" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
$line
