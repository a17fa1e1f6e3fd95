#!/usr/bin/env bash
# Packs this machine's Open MPI (Debian's 4.1, which the carried binaries link) into a relocatable
# folder for the GPU machine, whose image has no Open MPI of its own that matches: mpirun, the MCA
# plugins, PMIx, help texts and the libraries they need. Plugins for fabrics that machine lacks
# (UCX, OFI, verbs, PSM) and OpenSHMEM are left out. Used with OPAL_PREFIX and PMIX_PREFIX (see comm_optim.sh).
# usage: bench/gpu/make_ompi_bundle.sh DEST
set -euo pipefail
dest=$1
multiarch=/usr/lib/x86_64-linux-gnu
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib/x86_64-linux-gnu/openmpi/lib/openmpi3" "$dest/share"
cp -L /usr/bin/orterun "$dest/bin/mpirun"
cp -L /usr/bin/orted "$dest/bin/orted"
for lib in libmpi.so.40 libopen-rte.so.40 libopen-pal.so.40 libmca_common_sm.so.40 libmca_common_monitoring.so.50 \
           libmca_common_ompio.so.41 libhwloc.so.15 libevent_core-2.1.so.7 libevent_pthreads-2.1.so.7 \
           libevent-2.1.so.7 libudev.so.1 libltdl.so.7 libmunge.so.2; do
  [ -e "$multiarch/$lib" ] && cp -L "$multiarch/$lib" "$dest/lib/"
done
cp -a "$multiarch/pmix2" "$dest/pmix2"
rm -rf "$dest/pmix2/lib/libpmix.a" "$dest/pmix2/include"
cp -L "$dest/pmix2/lib/libpmix.so.2" "$dest/lib/"
cp -a /usr/share/openmpi "$dest/share/openmpi"
for plugin in "$multiarch"/openmpi/lib/openmpi3/*.so; do
  case $(basename "$plugin") in
    *ucx*|*ofi*|*openib*|*psm*|*verbs*|*usnic*|*java*|*slurm*|*flux*|*jsm*|*gridengine*|*netlink*) continue ;;
    mca_scoll_*|mca_spml_*|mca_sshmem_*|mca_memheap_*|mca_atomic_*) continue ;;  # OpenSHMEM, not MPI
  esac
  cp -L "$plugin" "$dest/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/"
done
du -sh "$dest"
