# check-rooms on planted violations (ctest check-rooms-plants): a small tree that obeys every rule
# must pass; the same tree with one bad include (or one file in no room) must fail, naming the file.
#   cmake -DCHECK=<repo>/tests/check-rooms.cmake -DWORK=<scratch folder> -P tests/check-rooms-test.cmake
cmake_minimum_required(VERSION 3.25)
if(NOT CHECK OR NOT WORK)
  message(FATAL_ERROR "check-rooms-test: pass -DCHECK=<check-rooms.cmake> -DWORK=<scratch folder>")
endif()

# A tree within the rules: every room, a lower room's private .cuh used by a .cu above it, cli on
# fovea/serve.h, public headers on lower public headers.
set(clean
    "src/core/io.cpp|#include \"fovea/io.h\"\n#include \"fovea/error.h\"\n#include <vector>\n"
    "src/fp8/scale-book.cpp|#include \"fovea/scales.h\"\n#include \"fovea/threads.h\"\n"
    "src/attention/cuda/kernels.cuh|#include \"fovea/attention.h\"\n#include \"fovea/cuda-support.h\"\n"
    "src/attention/cuda/flash.cu|#include \"attention/cuda/kernels.cuh\"\n"
    "src/model/qwen3vl/forward.cu|#include \"attention/cuda/kernels.cuh\"\n#include \"fovea/encoder.h\"\n"
    "src/image/decoders.h|#include \"fovea/image.h\"\n"
    "src/image/decode.cpp|#include \"image/decoders.h\"\n#include \"fovea/model.h\"\n"
    "src/video/video.cpp|#include \"fovea/video.h\"\n#include \"fovea/image.h\"\n"
    "src/engine/runner.cpp|#include \"fovea/pipeline.h\"\n#include \"fovea/video.h\"\n#include \"fovea/encoder.h\"\n"
    "src/server/http.h|#include \"fovea/serve.h\"\n"
    "src/server/server.cpp|#include \"server/http.h\"\n#include \"fovea/ec-cache.h\"\n"
    "src/cli/commands.h|#include \"fovea/engine.h\"\n"
    "src/cli/cmd-serve.cpp|#include \"cli/commands.h\"\n#include <fovea/serve.h>\n"
    "include/fovea/scales.h|#include \"fovea/fp8.h\"\n"
    "include/fovea/image.h|#include \"fovea/model.h\"\n"
    "include/fovea/serve.h|#include \"fovea/engine.h\"\n#include \"fovea/video.h\"\n")

# Writes the clean tree under WORK/<name>, then `plant` ("path|text": a file added, or appended to).
function(make_tree name plant)
  set(root ${WORK}/${name})
  file(REMOVE_RECURSE ${root})
  foreach(entry ${clean} ${plant})
    string(FIND "${entry}" "|" bar)
    string(SUBSTRING "${entry}" 0 ${bar} path)
    math(EXPR from "${bar} + 1")
    string(SUBSTRING "${entry}" ${from} -1 text)
    string(REPLACE "\\n" "\n" text "${text}")
    string(REPLACE "\\\"" "\"" text "${text}")
    file(APPEND ${root}/${path} "${text}")
  endforeach()
endfunction()

function(run_check name out_rc out_text)
  execute_process(COMMAND ${CMAKE_COMMAND} -DSRC=${WORK}/${name}/src -DINCLUDE=${WORK}/${name}/include/fovea
                          -DMIN_FILES=1 -P ${CHECK}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${out_rc} ${rc} PARENT_SCOPE)
  set(${out_text} "${out}${err}" PARENT_SCOPE)
endfunction()

set(failures "")

make_tree(clean "")
run_check(clean rc text)
if(NOT rc EQUAL 0 OR NOT text MATCHES "every one within its room's rules")
  list(APPEND failures "the clean tree failed (rc ${rc}):\n${text}")
endif()

# name | the planted file and line | what the failure must say
set(cases
    "core-includes-engine|src/core/io.cpp|#include \"fovea/pipeline.h\"\n|src/core/io.cpp (core): includes \"fovea/pipeline.h\", of room engine, above core"
    "fp8-includes-attention-cu|src/fp8/amax.cu|#include \"fovea/attention.h\"\n|src/fp8/amax.cu (fp8): includes \"fovea/attention.h\", of room attention, above fp8"
    "attention-cuh-includes-model|src/attention/cuda/kernels.cuh|#include \"model/qwen3vl/layout.h\"\n|src/attention/cuda/kernels.cuh (attention): includes \"model/qwen3vl/layout.h\", of room model, above attention"
    "model-includes-image|src/model/qwen3vl/forward.cu|#include \"fovea/image.h\"\n|src/model/qwen3vl/forward.cu (model): includes \"fovea/image.h\", of room image, above model"
    "image-includes-video|src/image/decode.cpp|#include \"fovea/video.h\"\n|src/image/decode.cpp (image): includes \"fovea/video.h\", of room video, above image"
    "video-includes-engine-angled|src/video/video.cpp|#include <fovea/engine.h>\n|src/video/video.cpp (video): includes \"fovea/engine.h\", of room engine, above video"
    "engine-includes-server|src/engine/runner.cpp|#include \"fovea/serve.h\"\n|src/engine/runner.cpp (engine): includes \"fovea/serve.h\", of room server, above engine"
    "server-includes-cli|src/server/server.cpp|#include \"cli/commands.h\"\n|src/server/server.cpp (server): includes \"cli/commands.h\", of room cli, beside server"
    "cli-includes-server-private|src/cli/cmd-serve.cpp|#include \"server/http.h\"\n|src/cli/cmd-serve.cpp (cli): includes \"server/http.h\", the server's private header"
    "public-header-upward|include/fovea/image.h|#include \"fovea/video.h\"\n|include/fovea/image.h (image): includes \"fovea/video.h\", of room video, above image"
    "public-header-private|include/fovea/scales.h|#include \"fp8/book.h\"\n|include/fovea/scales.h (public, fp8): includes the private header \"fp8/book.h\""
    "unknown-public-header|src/image/decode.cpp|#include \"fovea/colors.h\"\n|src/image/decode.cpp (image): fovea/colors.h is in no room"
    "relative-include|src/engine/runner.cpp|#include \"batch.h\"\n|src/engine/runner.cpp (engine): \"batch.h\" is neither fovea/<header> nor <room>/<path>"
    "header-in-no-room|include/fovea/colors.h|#pragma once\n|include/fovea/colors.h: in no room"
    "folder-in-no-room|src/tools/tool.cpp|#include \"fovea/io.h\"\n|src/tools/tool.cpp: in no room")

foreach(c ${cases})
  string(REPLACE "|" ";" parts "${c}")
  list(GET parts 0 name)
  list(GET parts 1 path)
  list(GET parts 2 line)
  list(GET parts 3 expected)
  string(REPLACE "\\\"" "\"" expected "${expected}")
  make_tree(${name} "${path}|${line}")
  run_check(${name} rc text)
  string(FIND "${text}" "${expected}" at)
  if(rc EQUAL 0)
    list(APPEND failures "${name}: check-rooms passed a tree with ${path}: ${line}")
  elseif(at EQUAL -1)
    list(APPEND failures "${name}: the failure does not say '${expected}':\n${text}")
  elseif(NOT text MATCHES "include rules broken")
    list(APPEND failures "${name}: failed for another reason:\n${text}")
  endif()
endforeach()

if(failures)
  list(JOIN failures "\n" text)
  message(FATAL_ERROR "check-rooms-test:\n${text}")
endif()
list(LENGTH cases n)
message(STATUS "check-rooms-test: the clean tree passes; all ${n} planted violations fail, each named")
