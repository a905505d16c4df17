# Sourced first by the scripts that run on the GPU machine, from the repository root: unpacks the
# binaries that scripts/gpu-prepare.sh packed into .gpu/bins.tar.gz (graphed, cargo-nextest, the
# examples), unless they are unpacked already. They are packed because the device tool carries at
# most 64 MiB with the tree.
if [ ! -x .gpu/graphed ] && [ -f .gpu/bins.tar.gz ]; then
    tar xf .gpu/bins.tar.gz -C .gpu
fi
