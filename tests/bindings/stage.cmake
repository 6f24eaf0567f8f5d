# Prepares what the language bindings' tests use: this build installed into STAGE (they find it
# there through pkg-config, as users find an installed libpipe) and one folder FIXTURES with the
# demo model and the slow_loop model.
#   cmake -DBUILD=... -DSTAGE=... -DFIXTURES=... -DDEMO=... -DMODELS=... -P stage.cmake
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD}" --prefix "${STAGE}"
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installing ${BUILD} into ${STAGE} failed")
endif()
file(MAKE_DIRECTORY "${FIXTURES}")
file(COPY "${DEMO}/demo.pt" "${DEMO}/demo.inputs.safetensors" "${DEMO}/demo.expected.safetensors"
          "${MODELS}/slow_loop.scripted.pt" "${MODELS}/slow_loop.inputs.safetensors"
          "${MODELS}/slow_loop.expected.safetensors"
     DESTINATION "${FIXTURES}")
