# Install rules: headers, the shared and static library, a CMake package
# (find_package(kvferry): kvferry::kvferry, kvferry::kvferry_static) and a
# pkg-config file (kvferry.pc). Both are relocatable: they find the prefix
# from their own location, so `cmake --install build --prefix DIR` works for
# any DIR.
include(CMakePackageConfigHelpers)

set(KVF_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvferry" CACHE STRING
    "Where kvferryConfig.cmake goes, relative to the prefix")
set(KVF_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig" CACHE STRING
    "Where kvferry.pc goes, relative to the prefix")

# Installed programs find the installed libkvferry.so relative to themselves,
# whatever the prefix.
if(NOT IS_ABSOLUTE "${CMAKE_INSTALL_BINDIR}" AND NOT IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  file(RELATIVE_PATH _kvf_bin_to_lib "/kvf/${CMAKE_INSTALL_BINDIR}" "/kvf/${CMAKE_INSTALL_LIBDIR}")
  set(_kvf_install_rpath "$ORIGIN/${_kvf_bin_to_lib}")
else()
  set(_kvf_install_rpath "${CMAKE_INSTALL_FULL_LIBDIR}")
endif()
foreach(_kvf_prog kvferry kvferryd)
  if(TARGET ${_kvf_prog})
    set_property(TARGET ${_kvf_prog} PROPERTY INSTALL_RPATH "${_kvf_install_rpath}")
  endif()
endforeach()

install(TARGETS kvferry_shared kvferry_static
  EXPORT kvferryTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Public headers only: internal ones live next to the sources, not here.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/kvferry
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/kvferry/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvferry)

install(EXPORT kvferryTargets
  NAMESPACE kvferry::
  FILE kvferryTargets.cmake
  DESTINATION ${KVF_INSTALL_CMAKEDIR})

# What the package config needs to find the static library's dependencies.
set(KVF_PACKAGE_WITH_CUDA ${KVF_WITH_CUDA})
set(KVF_PACKAGE_CUDA_ROOT "")
if(KVF_WITH_CUDA AND DEFINED CUDAToolkit_LIBRARY_ROOT)
  set(KVF_PACKAGE_CUDA_ROOT "${CUDAToolkit_LIBRARY_ROOT}")
endif()
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/kvferryConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/kvferryConfig.cmake
  INSTALL_DESTINATION ${KVF_INSTALL_CMAKEDIR})
# Until 1.0 a minor release may break the API: only the same minor matches.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/cmake/kvferryConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/cmake/kvferryConfig.cmake
  ${PROJECT_BINARY_DIR}/cmake/kvferryConfigVersion.cmake
  DESTINATION ${KVF_INSTALL_CMAKEDIR})

# pkg-config: ${pcfiledir}-relative prefix, so the file survives relocation.
if(IS_ABSOLUTE "${KVF_INSTALL_PKGCONFIGDIR}")
  set(KVF_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH _kvf_pc_up "/kvf/${KVF_INSTALL_PKGCONFIGDIR}" "/kvf")
  string(REGEX REPLACE "/$" "" _kvf_pc_up "${_kvf_pc_up}")
  set(KVF_PC_PREFIX "\${pcfiledir}/${_kvf_pc_up}")
endif()
foreach(_kvf_dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${_kvf_dir}}")
    set(KVF_PC_${_kvf_dir} "${CMAKE_INSTALL_${_kvf_dir}}")
  else()
    set(KVF_PC_${_kvf_dir} "\${prefix}/${CMAKE_INSTALL_${_kvf_dir}}")
  endif()
endforeach()
# Static linking needs what the library links privately. jansson and hwloc
# go here as plain -l flags rather than Requires.private: that would make
# `pkg-config --static` demand their own static dependencies (libudev for
# hwloc) even when only libkvferry.a is linked statically.
string(REPLACE ";" " " KVF_PC_LIBS_PRIVATE "${JANSSON_LDFLAGS};${HWLOC_LDFLAGS}")
string(APPEND KVF_PC_LIBS_PRIVATE " ")
if(KVF_WITH_CUDA)
  get_filename_component(_kvf_cudart_dir "${CUDA_cudart_static_LIBRARY}" DIRECTORY)
  string(APPEND KVF_PC_LIBS_PRIVATE "-L${_kvf_cudart_dir} -lcudart_static -lrt ")
endif()
string(APPEND KVF_PC_LIBS_PRIVATE "-lpthread ")
if(CMAKE_DL_LIBS)
  string(APPEND KVF_PC_LIBS_PRIVATE "-l${CMAKE_DL_LIBS}")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/kvferry.pc.in ${PROJECT_BINARY_DIR}/kvferry.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/kvferry.pc DESTINATION ${KVF_INSTALL_PKGCONFIGDIR})
