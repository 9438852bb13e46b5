#!/usr/bin/env python3
"""Platform tags for fovea-attn wheels that carry libfovea_attn.so (docs/python.md §Install).

A wheel holding a native library is not `py3-none-any`. Its tags are read from the library itself:
  platform   manylinux_2_<M>_<arch>: M is the highest GLIBC_2.M symbol version the library needs (its
             ELF version-needed section, what `readelf --version-info` prints), arch from the ELF
             header's machine (x86_64, aarch64).
  local      +cu<major><minor> when the library holds CUDA code (an .nv_fatbin section or a NEEDED
             libcudart.so.N): the toolkit of the build (BUILD/CMakeFiles/*/CMakeCUDACompiler.cmake),
             whose major must be the N of libcudart.so.N. A CPU-only library gets no local version.
Python tag py3 and ABI tag none: the package reaches the library through ctypes, no CPython ABI.

  wheel-tag.py tags LIB [--build DIR]    prints "PLATFORM LOCAL" (LOCAL is "-" for a CPU library)
  wheel-tag.py retag WHEEL PLATFORM      rewrites WHEEL (Tag, Root-Is-Purelib), RECORD and the name
  wheel-tag.py check WHEEL [--build DIR] fails on a none-any wheel with a .so, a platform or local
                                         version the library inside does not give, a bad RECORD
Standard library only (no auditwheel, no `wheel` package): nothing is downloaded.
"""
import argparse
import base64
import csv
import glob
import hashlib
import io
import os
import re
import struct
import sys
import zipfile

MACHINES = {62: "x86_64", 183: "aarch64"}  # ELF e_machine
SHT_GNU_VERNEED = 0x6FFFFFFE
SHT_DYNAMIC = 6
DT_NEEDED = 1


class TagError(Exception):
    pass


# ---- the library ----------------------------------------------------------------------------------

def elf_info(data, name="library"):
    """Architecture, highest GLIBC_2.x needed, NEEDED libraries and section names of a 64-bit LE ELF."""
    if data[:4] != b"\x7fELF":
        raise TagError(f"{name}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise TagError(f"{name}: not a 64-bit little-endian ELF (the wheel tags know x86_64 and aarch64)")
    machine, = struct.unpack_from("<H", data, 18)
    if machine not in MACHINES:
        raise TagError(f"{name}: ELF machine {machine} is neither x86_64 nor aarch64")
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 58)
    sections = []
    for i in range(shnum):
        sh_name, sh_type, _, _, sh_offset, sh_size, sh_link, sh_info, _, sh_entsize = \
            struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append((sh_name, sh_type, sh_offset, sh_size, sh_link, sh_info))

    def cstr(offset):
        return data[offset:data.index(b"\0", offset)].decode("ascii", "replace")

    names = [cstr(sections[shstrndx][2] + s[0]) for s in sections]
    glibc, needed = (2, 0), []
    for sh_name, sh_type, off, size, link, info in sections:
        strtab = sections[link][2]
        if sh_type == SHT_GNU_VERNEED:  # Elf64_Verneed entries (info of them), each with Vernaux entries
            vn = off
            for _ in range(info):
                _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", data, vn)
                va = vn + aux
                for _ in range(cnt):
                    _, _, _, vna_name, vna_next = struct.unpack_from("<IHHII", data, va)
                    m = re.fullmatch(r"GLIBC_2\.(\d+)(?:\.\d+)?", cstr(strtab + vna_name))
                    if m:
                        glibc = max(glibc, (2, int(m.group(1))))
                    va += vna_next
                vn += nxt
                if not nxt:
                    break
        elif sh_type == SHT_DYNAMIC:
            for pos in range(off, off + size, 16):
                tag, val = struct.unpack_from("<qQ", data, pos)
                if tag == 0:
                    break
                if tag == DT_NEEDED:
                    needed.append(cstr(strtab + val))
    return {"arch": MACHINES[machine], "glibc": glibc, "needed": needed, "sections": names}


def platform_tag(info):
    return f"manylinux_{info['glibc'][0]}_{info['glibc'][1]}_{info['arch']}"


def cudart_major(info):
    """N of a NEEDED libcudart.so.N, or None."""
    for lib in info["needed"]:
        m = re.fullmatch(r"libcudart\.so\.(\d+)", lib)
        if m:
            return int(m.group(1))
    return None


def has_cuda(info):
    return ".nv_fatbin" in info["sections"] or cudart_major(info) is not None


def build_cuda_version(build):
    """(major, minor) of the CUDA toolkit CMake configured BUILD with, or None."""
    found = set()
    for path in glob.glob(os.path.join(build, "CMakeFiles", "*", "CMakeCUDACompiler.cmake")):
        with open(path) as f:
            text = f.read()
        m = (re.search(r'CMAKE_CUDA_COMPILER_TOOLKIT_VERSION "(\d+)\.(\d+)', text) or
             re.search(r'CMAKE_CUDA_COMPILER_VERSION "(\d+)\.(\d+)', text))
        if m:
            found.add((int(m.group(1)), int(m.group(2))))
    if len(found) > 1:
        raise TagError(f"{build}: CMake recorded several CUDA toolkits {sorted(found)}: reconfigure the build")
    return found.pop() if found else None


def local_version(info, build=None, name="library"):
    """'cuXY' for a CUDA library (toolkit from BUILD, checked against libcudart.so.N), None for CPU-only.
    Without BUILD only the major is known (from libcudart): returns 'cuX*' as a pattern."""
    if not has_cuda(info):
        return None
    major = cudart_major(info)
    version = build_cuda_version(build) if build else None
    if version is None:
        if build:
            raise TagError(f"{name} holds CUDA code but {build} records no CUDA toolkit "
                           "(CMakeFiles/*/CMakeCUDACompiler.cmake)")
        if major is None:
            raise TagError(f"{name} holds CUDA code linked without libcudart.so.N: give the build folder")
        return f"cu{major}*"
    if major is not None and major != version[0]:
        raise TagError(f"{name} needs libcudart.so.{major} but {build} was configured with CUDA "
                       f"{version[0]}.{version[1]}")
    return f"cu{version[0]}{version[1]}"


# ---- the wheel ------------------------------------------------------------------------------------

WHEEL_NAME = re.compile(r"(?P<dist>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?"
                        r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl")


def record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def read_wheel(path):
    m = WHEEL_NAME.fullmatch(os.path.basename(path))
    if not m:
        raise TagError(f"{path}: not a wheel file name")
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    dist_info = f"{m['dist']}-{m['version']}.dist-info/"
    files = {i.filename: d for i, d in entries}
    for need in ("WHEEL", "METADATA", "RECORD"):
        if dist_info + need not in files:
            raise TagError(f"{path}: no {dist_info}{need}")
    return m, entries, dist_info


def retag(path, plat):
    """Rewrites WHEEL's Tag and Root-Is-Purelib, RECORD's hashes and the file name; returns the new path."""
    m, entries, dist_info = read_wheel(path)
    wheel_lines = [line for line in entries_text(entries, dist_info + "WHEEL").splitlines()
                   if not line.startswith(("Tag:", "Root-Is-Purelib:"))]
    wheel_lines[1:1] = ["Root-Is-Purelib: false", f"Tag: py3-none-{plat}"]
    new_wheel = ("\n".join(wheel_lines) + "\n").encode()
    out = io.BytesIO()
    rows = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in entries:
            if info.filename == dist_info + "RECORD":
                continue
            if info.filename == dist_info + "WHEEL":
                data = new_wheel
            z.writestr(info, data, zipfile.ZIP_DEFLATED)
            rows.append([info.filename, record_hash(data), str(len(data))])
        rows.append([dist_info + "RECORD", "", ""])
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(rows)
        rinfo = zipfile.ZipInfo(dist_info + "RECORD", date_time=entries[0][0].date_time)
        rinfo.external_attr = 0o644 << 16
        z.writestr(rinfo, record.getvalue().encode(), zipfile.ZIP_DEFLATED)
    build = f"-{m['build']}" if m["build"] else ""
    new_path = os.path.join(os.path.dirname(path), f"{m['dist']}-{m['version']}{build}-py3-none-{plat}.whl")
    with open(new_path + ".tmp", "wb") as f:
        f.write(out.getvalue())
    os.replace(new_path + ".tmp", new_path)
    if os.path.abspath(new_path) != os.path.abspath(path):
        os.remove(path)
    return new_path


def entries_text(entries, name):
    return next(d for i, d in entries if i.filename == name).decode()


def check(path, build=None):
    """Every rule of the module docstring; raises TagError naming the first broken one."""
    m, entries, dist_info = read_wheel(path)
    files = {i.filename: d for i, d in entries}
    wheel = entries_text(entries, dist_info + "WHEEL")
    tags = re.findall(r"^Tag: (\S+)$", wheel, re.M)
    name_tag = f"{m['py']}-{m['abi']}-{m['plat']}"
    if tags != [name_tag]:
        raise TagError(f"{path}: WHEEL says Tag {tags}, the file name {name_tag}")
    version = re.search(r"^Version: (\S+)$", entries_text(entries, dist_info + "METADATA"), re.M)
    if not version or version.group(1) != m["version"]:
        raise TagError(f"{path}: METADATA's Version {version and version.group(1)} is not the name's {m['version']}")
    for row in csv.reader(io.StringIO(entries_text(entries, dist_info + "RECORD"))):
        if row and row[0] != dist_info + "RECORD":
            if row[0] not in files or row[1] != record_hash(files[row[0]]) or row[2] != str(len(files[row[0]])):
                raise TagError(f"{path}: RECORD's hash or size of {row[0]} does not match the file")
    recorded = {row[0] for row in csv.reader(io.StringIO(entries_text(entries, dist_info + "RECORD"))) if row}
    if set(files) - recorded:
        raise TagError(f"{path}: not in RECORD: {sorted(set(files) - recorded)}")
    libs = [n for n in files if re.search(r"\.so(\.\d+)*$", n)]
    local = m["version"].partition("+")[2] or None
    if not libs:
        if m["plat"] != "any" or local:
            raise TagError(f"{path}: no native library, yet tagged {m['plat']} / +{local}")
        return f"{name_tag} (pure Python)"
    if m["plat"] == "any" or m["abi"] != "none" or m["py"] != "py3":
        raise TagError(f"{path}: tagged {name_tag} but carries {', '.join(libs)}: it is not none-any "
                       "(scripts/python-wheel.sh tags it from the library)")
    if not re.search(r"^Root-Is-Purelib: false$", wheel, re.M):
        raise TagError(f"{path}: carries {', '.join(libs)} but WHEEL does not say Root-Is-Purelib: false")
    plats, locals_ = set(), set()
    for lib in libs:
        info = elf_info(files[lib], lib)
        plats.add(platform_tag(info))
        locals_.add(local_version(info, build, lib))
    if len(plats) != 1 or len(locals_) != 1:
        raise TagError(f"{path}: its libraries disagree: platforms {sorted(plats)}, CUDA {sorted(map(str, locals_))}")
    plat, want = plats.pop(), locals_.pop()
    if m["plat"] != plat:
        raise TagError(f"{path}: tagged {m['plat']}, its library needs {plat}")
    if want is None and local:
        raise TagError(f"{path}: local version +{local} but its library holds no CUDA code (a CPU build gets none)")
    if want is not None and not (local == want or (want.endswith("*") and local and
                                                    re.fullmatch(want[:-1] + r"\d+", local))):
        raise TagError(f"{path}: local version {'+' + local if local else '(none)'}, its library is built "
                       f"with CUDA: +{want.rstrip('*')}{'X' if want.endswith('*') else ''}")
    return f"{name_tag}, version {m['version']}"


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tags")
    t.add_argument("lib")
    t.add_argument("--build")
    r = sub.add_parser("retag")
    r.add_argument("wheel")
    r.add_argument("platform")
    c = sub.add_parser("check")
    c.add_argument("wheel")
    c.add_argument("--build")
    a = p.parse_args(argv)
    try:
        if a.cmd == "tags":
            with open(a.lib, "rb") as f:
                info = elf_info(f.read(), a.lib)
            local = local_version(info, a.build, a.lib)
            if local and local.endswith("*"):
                raise TagError(f"{a.lib} holds CUDA {local[2:-1]}.x code: give --build for the minor version")
            print(platform_tag(info), local or "-")
        elif a.cmd == "retag":
            print(retag(a.wheel, a.platform))
        else:
            print("wheel-tag: ok:", check(a.wheel, a.build))
    except TagError as e:
        print(f"wheel-tag: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
