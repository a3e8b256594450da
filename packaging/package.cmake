# The Debian package (scripts/package) and what a system install puts
# besides the binaries: man pages, documentation, an uninstall target.

install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/man/ DESTINATION ${CMAKE_INSTALL_MANDIR}/man1 FILES_MATCHING PATTERN "*.1")
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs FILES_MATCHING PATTERN "*.md")

# `cmake --build build --target uninstall` removes what `cmake --install build` put.
add_custom_target(uninstall
  COMMAND ${CMAKE_COMMAND} -DMANIFEST=${CMAKE_BINARY_DIR}/install_manifest.txt -P ${CMAKE_CURRENT_LIST_DIR}/uninstall.cmake
  COMMENT "Removing the files of the last install")

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME softverbs)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "softverbs developers <softverbs@users.noreply.github.com>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "userspace RDMA device emulator for unmodified RDMA programs")
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "softverbs is a libibverbs provider plugin and a drop-in librdmacm.so.1 that
 let unmodified RDMA programs (rdma-core's tools, perftest, UCX, libfabric,
 Open MPI) run on emulated devices: over shared memory on one host, and as
 RoCEv2 over UDP across hosts, containers and network namespaces.
 .
 Programs that do not use softverbs are not affected by the installation:
 its devices are visible to programs started through softverbs run.")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# dpkg-shlibdeps declares the shared libraries it needs (libibverbs1,
# libisal2, libc6, libstdc++6).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "ibverbs-utils, rdmacm-utils")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "perftest, tshark")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA "${CMAKE_CURRENT_LIST_DIR}/prerm")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_STRIP_FILES ON)
include(CPack)
