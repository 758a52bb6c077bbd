# Compiles each header of HEADERS alone: a generated .cpp that includes only it, with the CPU build's
# compiler and flags, syntax only. A header that needs something included before it (a type, a macro,
# a declaration of the trainer's) fails, named. Exits non-zero when any fails.
#   cmake -DCOMPILER=g++ -DFLAGS=a|b|c -DREPO=... -DWORK=dir -DHEADERS=runtime/a.h|profiler/b.h -P compile_alone.cmake
# The planted twin: PLANT=runtime/x.h and DROP=<an include line of it>: its copy without that line (a
# header that now needs that include first) is checked instead; the copy must compile after DROP's
# header and fail alone, or the check proves nothing.
foreach(var COMPILER FLAGS REPO WORK HEADERS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "compile_alone.cmake: -D${var}=... is missing")
  endif()
endforeach()
string(REPLACE "|" ";" FLAGS "${FLAGS}")
string(REPLACE "|" ";" HEADERS "${HEADERS}")
file(MAKE_DIRECTORY ${WORK})

# Whether `text` compiles as a .cpp of its own; the compiler's first error lines in `err_out`.
function(compiles name text ok_out err_out)
  set(src ${WORK}/${name}.cpp)
  file(WRITE ${src} "${text}")
  execute_process(COMMAND ${COMPILER} ${FLAGS} -I${REPO} -I${WORK} -fsyntax-only ${src}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX MATCH "[^\n]*error[^\n]*" first "${err}")
  set(${err_out} "${first}" PARENT_SCOPE)
  if(rc EQUAL 0)
    set(${ok_out} TRUE PARENT_SCOPE)
  else()
    set(${ok_out} FALSE PARENT_SCOPE)
  endif()
endfunction()

if(DEFINED PLANT)
  file(READ ${REPO}/${PLANT} text)
  string(FIND "${text}" "${DROP}\n" at)
  if(at LESS 0)
    message(FATAL_ERROR "compile_alone.cmake: ${PLANT} has no line '${DROP}' to drop: choose another planted include")
  endif()
  string(REPLACE "${DROP}\n" "" text "${text}")
  set(twin planted/${PLANT})
  file(WRITE ${WORK}/${twin} "${text}")
  string(REGEX REPLACE "^#include \"(\\.\\./)*" "" prior "${DROP}")
  string(REGEX REPLACE "\"$" "" prior "${prior}")
  compiles(planted_after_prior "#include \"${prior}\"\n#include \"${twin}\"\n" ok err)
  if(NOT ok)
    message(FATAL_ERROR "compile_alone.cmake: the planted twin ${twin} does not compile even after ${prior}: ${err}")
  endif()
  set(HEADERS ${twin})
endif()

set(failed "")
list(LENGTH HEADERS count)
foreach(h ${HEADERS})
  string(MAKE_C_IDENTIFIER "${h}" name)
  compiles(${name} "#include \"${h}\"\n" ok err)
  if(NOT ok)
    message("${h} does not compile alone: ${err}")
    list(APPEND failed ${h})
  endif()
endforeach()
list(LENGTH failed bad)
if(bad GREATER 0)
  message(FATAL_ERROR "${bad} of ${count} headers do not compile alone (each must include what it uses)")
endif()
message("${count} headers compile alone")
