# Prepares what the language bindings' tests use: this build installed into STAGE (they find it
# there through pkg-config, as users find an installed libpipe) and one folder FIXTURES with the
# demo model, the slow_loop model, the gated model and the test gate (tests/gate: the operator
# library libpipe_test_gate.so, which a test process loads before the gated model, and gate.py),
# storeport.py (reads the port a driver's store picked, from libpipe's log), and the decoders of
# the generation tests (tiny_decoder.pt with its expected greedy tokens, gated_decoder.pt; made by
# the decoder_models fixture, tests/models/decoder_models.py), and exported/multi_mlp.pt2 (a
# torch.export program with its inputs and eager outputs, tests/models/exported_models.py), and text/: tokenizer
# folders in the styles of GPT-2, Qwen2, Llama and Mistral (tests/models/text_tokenizers.py).
#   cmake -DBUILD=... -DSTAGE=... -DFIXTURES=... -DDEMO=... -DMODELS=... -DGATE_LIB=... -DGATE_PY=... \
#         -DSTOREPORT_PY=... -P stage.cmake
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD}" --prefix "${STAGE}"
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installing ${BUILD} into ${STAGE} failed")
endif()
file(MAKE_DIRECTORY "${FIXTURES}")
file(COPY "${DEMO}/demo.pt" "${DEMO}/demo.inputs.safetensors" "${DEMO}/demo.expected.safetensors"
          "${MODELS}/slow_loop.scripted.pt" "${MODELS}/slow_loop.inputs.safetensors"
          "${MODELS}/slow_loop.expected.safetensors"
          "${MODELS}/gated.scripted.pt" "${MODELS}/gated.inputs.safetensors" "${MODELS}/gated.expected.safetensors"
          "${MODELS}/tiny_decoder.pt" "${MODELS}/tiny_decoder.expected.json" "${MODELS}/gated_decoder.pt"
          "${GATE_LIB}" "${GATE_PY}" "${STOREPORT_PY}"
     DESTINATION "${FIXTURES}")
file(COPY "${MODELS}/exported/multi_mlp.pt2" "${MODELS}/exported/multi_mlp.inputs.safetensors"
          "${MODELS}/exported/multi_mlp.expected.safetensors"
     DESTINATION "${FIXTURES}/exported")
# Tokenizer folders in four styles with transformers' ids and chat text (tests/models/text_tokenizers.py).
file(COPY "${MODELS}/text" DESTINATION "${FIXTURES}")
