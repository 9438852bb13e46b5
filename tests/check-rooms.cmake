# The include rules of docs/architecture.md (ctest check-rooms), checked on every #include of every
# .cpp, .h, .cu and .cuh under src/ and of every public header under include/fovea/:
#   cmake -DSRC=<repo>/src -DINCLUDE=<repo>/include/fovea -P tests/check-rooms.cmake
# MIN_FILES (default 50) guards against a wrong SRC; tests/check-rooms-test.cmake plants violations
# in a small tree with MIN_FILES=1.
#
# The rooms, from the bottom: core -> fp8 -> attention -> model -> image -> video -> engine ->
# {server, cli}. A file includes headers of its own room and of rooms below it, public
# (fovea/<name>.h) or private ("<room>/..."). server and cli are peers: neither includes the other,
# except that cli (the fovea executable, which links the server library) reaches the server through
# its public header fovea/serve.h. A public header includes public headers only.
cmake_minimum_required(VERSION 3.25)
if(NOT SRC)
  message(FATAL_ERROR "check-rooms: pass -DSRC=<repo>/src")
endif()
if(NOT INCLUDE)
  get_filename_component(INCLUDE "${SRC}/../include/fovea" ABSOLUTE)
endif()
if(NOT DEFINED MIN_FILES)
  set(MIN_FILES 50)
endif()

set(rooms core fp8 attention model image video engine server cli capi)
set(rank_core 0)
set(rank_fp8 1)
set(rank_attention 2)
set(rank_model 3)
set(rank_image 4)
set(rank_video 5)
set(rank_engine 6)
set(rank_server 7)
set(rank_cli 7)  # beside server
set(rank_capi 7)  # the C ABI (libfovea_attn.so), beside server and cli

# Each public header's room: the room that implements it, or for a header-only one, the lowest room
# it fits (what it includes) that matches what it is. A new header must be added here.
set(public_core
    error.h       # fovea::Error, fail, warn
    checked.h     # overflow-checked size math
    hd.h          # host/device qualifiers
    io.h          # bounded file reading, atomic writes
    json.h        # bounded JSON
    threads.h     # parallel_for, thread names
    sha256.h
    base64.h      # RFC 4648 (data URLs, serve's replies)
    blake3.h      # BLAKE3 (vLLM's multimodal keys)
    system.h      # the machine query (src/core/*cuda-device*)
    cuda-support.h  # CUDA checks, device and pinned buffers (CUDA builds)
    clock.h       # elapsed time
    lists.h)      # separated lists of flag values
set(public_fp8 fp8.h bf16.h scales.h fp8-plan.h)  # E4M3 and bf16 codecs (header-only, on hd.h), the scale book, the FP8 plan
set(public_attention attention.h attention-ref.h attention-gpu.h rope.h random.h flash-p.h)  # names and shapes, the CPU reference, the GPU backends; flash-p.h: how the FP8 kernel forms P (kernel and emulation)
set(public_model safetensors.h model.h encoder.h)
set(public_image image.h)
set(public_video video.h)
set(public_engine engine.h pipeline.h ec-cache.h)
set(public_server serve.h)
set(public_cli "")
set(public_capi fovea_attn.h)  # C, includes nothing of fovea's
foreach(room ${rooms})
  foreach(h ${public_${room}})
    set(room_of_${h} ${room})
  endforeach()
endforeach()

# The room of an included name ("fovea/x.h" or "<room>/..."), or a reason in `why`.
function(included_room name out_room out_public out_why)
  set(${out_room} "" PARENT_SCOPE)
  set(${out_why} "" PARENT_SCOPE)
  set(${out_public} FALSE PARENT_SCOPE)
  if(name MATCHES "^fovea/([^/]+)$")
    set(h ${CMAKE_MATCH_1})
    if(DEFINED room_of_${h})
      set(${out_room} ${room_of_${h}} PARENT_SCOPE)
      set(${out_public} TRUE PARENT_SCOPE)
    else()
      set(${out_why} "fovea/${h} is in no room (add it to tests/check-rooms.cmake's public_<room> lists)" PARENT_SCOPE)
    endif()
    return()
  endif()
  string(REGEX MATCH "^[^/]+" first "${name}")
  if(first IN_LIST rooms AND name MATCHES "/")
    set(${out_room} ${first} PARENT_SCOPE)
  else()
    set(${out_why} "\"${name}\" is neither fovea/<header> nor <room>/<path> (write it from src/)" PARENT_SCOPE)
  endif()
endfunction()

set(bad "")
set(count 0)
# Checks the includes of `path` (shown as `shown`), a file of room `room`; `public` when it is a public header.
function(check_file path shown room public)
  file(STRINGS ${path} lines REGEX "^[ \t]*#[ \t]*include")
  set(n 0)
  foreach(line ${lines})
    math(EXPR n "${n} + 1")
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\"")
      set(name ${CMAKE_MATCH_1})
    elseif(line MATCHES "^[ \t]*#[ \t]*include[ \t]*<(fovea/[^>]+)>")
      set(name ${CMAKE_MATCH_1})
    else()
      continue()  # a system or third-party header
    endif()
    included_room("${name}" to to_public why)
    if(why)
      list(APPEND bad "${shown} (${room}): ${why}")
      continue()
    endif()
    if(public AND NOT to_public)
      list(APPEND bad "${shown} (public, ${room}): includes the private header \"${name}\"; public headers include public ones only")
    elseif(to STREQUAL room)
      # its own room
    elseif(room STREQUAL "cli" AND to STREQUAL "server")
      if(NOT to_public)
        list(APPEND bad "${shown} (cli): includes \"${name}\", the server's private header; cli reaches the server through fovea/serve.h only")
      endif()
    elseif(NOT rank_${to} LESS rank_${room})
      if(rank_${to} EQUAL rank_${room})
        set(where "beside ${room}")
      else()
        set(where "above ${room}")
      endif()
      list(APPEND bad "${shown} (${room}): includes \"${name}\", of room ${to}, ${where} (docs/architecture.md, Include rules)")
    endif()
  endforeach()
  set(bad "${bad}" PARENT_SCOPE)
  math(EXPR total "${count} + ${n}")
  set(count ${total} PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE sources RELATIVE ${SRC} ${SRC}/*.cpp ${SRC}/*.h ${SRC}/*.cu ${SRC}/*.cuh)
foreach(f ${sources})
  string(REGEX MATCH "^[^/]+" room ${f})
  if(NOT f MATCHES "/" OR NOT room IN_LIST rooms)
    list(APPEND bad "src/${f}: in no room (src/${room}/ is not one of docs/architecture.md's rooms)")
    continue()
  endif()
  check_file(${SRC}/${f} src/${f} ${room} FALSE)
endforeach()

file(GLOB_RECURSE headers RELATIVE ${INCLUDE} ${INCLUDE}/*)
foreach(h ${headers})
  if(NOT DEFINED room_of_${h})
    list(APPEND bad "include/fovea/${h}: in no room (add it to tests/check-rooms.cmake's public_<room> lists)")
    continue()
  endif()
  check_file(${INCLUDE}/${h} include/fovea/${h} ${room_of_${h}} TRUE)
endforeach()

list(LENGTH sources nsources)
list(LENGTH headers nheaders)
math(EXPR nfiles "${nsources} + ${nheaders}")
if(nsources LESS MIN_FILES)
  message(FATAL_ERROR "check-rooms: found only ${nsources} files under ${SRC}")
endif()
if(bad)
  list(JOIN bad "\n  " text)
  message(FATAL_ERROR "check-rooms: include rules broken:\n  ${text}")
endif()
message(STATUS "check-rooms: ${nfiles} files (${nheaders} public headers), ${count} includes, every one within its room's rules")
